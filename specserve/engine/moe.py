"""The mixture-of-experts feed-forward (Qwen3-MoE, Mixtral), batch invariant.

:class:`MoE` replaces a layer's dense MLP where the config has experts
(:attr:`ModelConfig.num_experts <specserve.engine.config.ModelConfig.num_experts>`): a
router (``gate``, a linear map to one logit per expert), the softmax of a token's
logits, its ``top_k`` experts by probability (their probabilities renormalized to sum
to 1 where ``norm_topk_prob``: Qwen3-MoE's setting, Mixtral always), and the weighted
sum of those experts' SwiGLU outputs. Module names are the Hugging Face checkpoints'
(``mlp.gate``, ``mlp.experts.N.{gate,up,down}_proj``; Mixtral's are renamed to them
at load, :func:`~specserve.engine.families.checkpoint_name`).

**Batch invariance** (docs/exactness.md): a row's output has the same bits whether the
forward holds that row alone or among others (a speculative verify's k + 1 rows, other
sessions' rows). The rows that chose an expert are gathered and multiplied through it
together, and every op on that path gives a row the bits it has alone
(:mod:`specserve.engine.ops`: the CPU kernels up to
:data:`~specserve.engine.ops.MAX_KERNEL_ROWS` float rows, any count of quantized
ones; the router's softmax, top-k and scaling are per row). A row's weighted expert
outputs are then added into a zero row in **ascending expert index**, whichever
experts the other rows chose, so the order of its float additions is fixed by the
row alone. The dense path's limits hold here too: past ``MAX_KERNEL_ROWS`` float rows
an expert's products go to torch's GEMM, whose bits depend on the row count
(:meth:`CausalLM.forward <specserve.engine.model.CausalLM.forward>` keeps a verify's
logit rows under it).

Cost: which experts run depends on the data, so the forward reads the routing back on
the host (one synchronisation per layer) and issues three products per expert hit;
:class:`~specserve.engine.static_step.StaticStep` and CUDA graphs do not take such a
model (it is not a Llama layer), and it runs eagerly. Tensor parallelism splits every
expert as it splits the dense MLP (:mod:`specserve.engine.tp`); the router stays whole.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.engine.config import ModelConfig
from specserve.engine.ops import gate_up_silu, linear


class Expert(nn.Module):
    """One expert: a SwiGLU MLP of the experts' intermediate size."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, hidden]
        return linear(
            gate_up_silu(x, self.gate_proj.weight, self.up_proj.weight), self.down_proj.weight
        )


def route(
    logits: torch.Tensor,  # [tokens, experts] the router's logits
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # [tokens, top_k] float32 weights, int64 experts
    """Each token's ``top_k`` experts and their weights, as transformers routes: the
    softmax over all experts in float32, the ``top_k`` largest probabilities,
    renormalized to sum to 1 where ``renormalize``. Every op is per row."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class MoE(nn.Module):
    """The router and the experts of one layer (see the module doc)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.expert_intermediate_size) for _ in range(cfg.num_experts)
        )
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, hidden]
        weights, chosen = route(linear(x, self.gate.weight), self.top_k, self.renormalize)
        weights = weights.to(x.dtype)  # [tokens, top_k]
        out = torch.zeros_like(x)  # [tokens, hidden]
        hit = torch.bincount(chosen.view(-1), minlength=len(self.experts))
        # Ascending expert index: each row's additions into `out` come in that order.
        for e in hit.nonzero().view(-1).tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)  # a row chose e at most once
            y = self.experts[e](x.index_select(0, rows))  # [rows_e, hidden]
            out.index_add_(0, rows, y * weights[rows, slot].unsqueeze(1))
        return out
