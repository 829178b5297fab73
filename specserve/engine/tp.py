"""Tensor parallelism applied after load; the model is unaware of it.

:func:`apply_tp` shards a loaded :class:`~specserve.engine.model.CausalLM` in place
for one rank of ``world_size`` (Megatron layout, as gpt-fast's ``tp.py``):

* column-parallel (output features split): ``q_proj``, ``k_proj``, ``v_proj`` by
  whole heads, biases included, and ``gate_proj`` / ``up_proj``;
* row-parallel (input features split): ``o_proj`` and ``down_proj``, whose partial
  sums are added up by an all-reduce in a forward hook on :class:`Attention` and
  :class:`MLP`;
* a mixture of experts (:class:`~specserve.engine.moe.MoE`): every expert's
  ``gate_proj`` / ``up_proj`` column-parallel and ``down_proj`` row-parallel, as the
  dense MLP; the router stays whole, so every rank routes a token to the same experts
  and the all-reduce (a hook on the MoE) adds the ranks' weighted partial sums.

Rank ``r`` keeps query heads ``[r * H / N, (r + 1) * H / N)`` and KV heads
``[r * KV / N, (r + 1) * KV / N)``, which are exactly the KV heads those query heads
read under grouped-query attention, so attention needs no communication. The
decoder reads head counts from weight shapes and ``CausalLM.new_kv_pool`` sizes the
KV pool from the sharded ``k_proj``: each rank caches only its own KV heads.
Embeddings, norms and the LM head stay whole on every rank. Block-quantized weights
split along the same lines, on whole blocks (:func:`_shard_quantized`).

:func:`init_tp` joins the process group (NCCL on GPUs, gloo on CPU) with a
collective timeout, so a dead rank makes the others raise instead of hang.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from specserve.engine.errors import InvalidArgument, ModelLoadError
from specserve.engine.families import family
from specserve.engine.model import CausalLM
from specserve.engine.moe import MoE
from specserve.engine.quant import QuantizedWeight, block_format
from specserve.engine.quantized_layers import set_quantized_weight

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 30.0


class TPGroupError(RuntimeError):
    """A rank of the tensor-parallel group died or stopped answering; the group is unusable.

    Not an :class:`EngineError`: to a server this is a device failure (health turns
    NOT_SERVING), not a bad request.
    """


@dataclass(frozen=True)
class TPContext:
    """This process's place in a tensor-parallel group."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    timeout_s: float
    # The forward's all-reduces (NCCL on GPUs); None means the default group.
    group: dist.ProcessGroup | None = None
    # A gloo group for the pickled step messages: CPU objects, and a dead peer is
    # noticed here (a closed socket) before any NCCL kernel is queued.
    control: dist.ProcessGroup | None = None


def default_backend() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_tp(
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str = "env://",
    local_rank: int = 0,
) -> TPContext:
    """Join the default process group with collective timeout ``timeout_s``.

    With ``init_method="env://"`` (torchrun) rank and world size come from the
    environment unless given; other launchers pass ``tcp://host:port`` and both.
    NCCL ranks use ``cuda:local_rank`` and also get a gloo group for control messages.
    """
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise InvalidArgument(f"unknown TP backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if not timeout_s > 0:
        raise InvalidArgument(f"the TP collective timeout must be positive, got {timeout_s}")
    timeout = datetime.timedelta(seconds=timeout_s)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    ids = {} if rank is None else {"rank": rank, "world_size": world_size}
    dist.init_process_group(backend, init_method=init_method, timeout=timeout, **ids)
    group = dist.group.WORLD
    control = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TPContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        backend=backend,
        device=device,
        timeout_s=timeout_s,
        group=group,
        control=control,
    )


def shutdown_tp() -> None:
    """Leave the process group (a no-op when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def check_divisible(model: CausalLM, world_size: int) -> None:
    """Raise :class:`ModelLoadError` unless ``model`` splits evenly over ``world_size`` ranks."""
    cfg = model.config
    if world_size < 1:
        raise InvalidArgument(f"the TP size must be >= 1, got {world_size}")
    refusal = family(cfg.model_type).tp_refusal
    if refusal is not None and world_size > 1:
        raise ModelLoadError(
            f"cannot split {cfg.model_type} over {world_size} tensor-parallel ranks: {refusal}"
        )
    sizes = {
        "attention heads": cfg.num_heads,
        "KV heads": cfg.num_kv_heads,
    }
    if cfg.num_experts:
        sizes["expert intermediate size"] = cfg.expert_intermediate_size
    else:
        sizes["MLP intermediate size"] = cfg.intermediate_size
    bad = [f"{name} ({n})" for name, n in sizes.items() if n % world_size]
    if bad:
        listed = bad[0] if len(bad) == 1 else f"{', '.join(bad[:-1])} and {bad[-1]}"
        common = math.gcd(*sizes.values())
        valid = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
        raise ModelLoadError(
            f"cannot split {cfg.model_type} over {world_size} tensor-parallel ranks: "
            f"the {listed} must divide evenly by the TP size; "
            f"TP sizes that fit this model: {valid}"
        )


def apply_tp(
    model: CausalLM, rank: int, world_size: int, group: dist.ProcessGroup | None = None
) -> CausalLM:
    """Shard ``model`` in place for ``rank`` of ``world_size`` and return it.

    The all-reduce hooks use ``group`` (the default process group when None). With
    ``world_size == 1`` the model is returned unchanged.
    """
    check_divisible(model, world_size)
    if not 0 <= rank < world_size:
        raise InvalidArgument(f"rank {rank} is outside a TP group of {world_size}")
    if getattr(model, "_tp_shard", None) is not None:
        raise InvalidArgument("tensor parallelism was already applied to this model")
    if world_size == 1:
        return model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        # A mixture of experts: every expert split as the dense MLP, the router whole.
        mlps = list(mlp.experts) if isinstance(mlp, MoE) else [mlp]
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            _shard_linear(proj, 0, rank, world_size)
        for m in mlps:
            _shard_linear(m.gate_proj, 0, rank, world_size)
            _shard_linear(m.up_proj, 0, rank, world_size)
            _shard_linear(m.down_proj, 1, rank, world_size)
        _shard_linear(attn.o_proj, 1, rank, world_size)
        attn.register_forward_hook(_all_reduce_hook(group))
        mlp.register_forward_hook(_all_reduce_hook(group))
    model._tp_shard = (rank, world_size)
    return model


def _shard_linear(proj: nn.Linear, dim: int, rank: int, world_size: int) -> None:
    """Keep slice ``rank`` of ``world_size`` along ``dim`` of the weight ``[out, in]``.

    Output features are laid out head after head, so an even split along dim 0 keeps
    whole heads. A row-parallel bias is added once, after the all-reduce: only rank 0
    keeps it. A block-quantized weight is split the same way (:func:`_shard_quantized`).
    """
    shard: torch.Tensor | QuantizedWeight
    if isinstance(proj.weight, QuantizedWeight):
        shard = _shard_quantized(proj.weight, dim, rank, world_size)
        del proj.weight
        if isinstance(shard, QuantizedWeight):
            proj.out_features, proj.in_features = shard.shape
            set_quantized_weight(proj, shard)
            _shard_bias(proj, dim, rank, world_size)
            return
    else:
        weight = proj.weight.detach()  # [out, in]
        assert weight.shape[dim] % world_size == 0, (weight.shape, dim, world_size)
        # A fresh contiguous tensor, so the full weight is freed once the caller drops it.
        shard = weight.chunk(world_size, dim=dim)[rank].clone(memory_format=torch.contiguous_format)
    proj.weight = nn.Parameter(shard, requires_grad=False)
    proj.out_features, proj.in_features = shard.shape
    _shard_bias(proj, dim, rank, world_size)


def _shard_quantized(
    weight: QuantizedWeight, dim: int, rank: int, world_size: int
) -> QuantizedWeight | torch.Tensor:
    """Slice ``rank`` of a quantized weight: whole rows of blocks along dim 0; along dim 1
    whole blocks of every row where each rank's columns are whole blocks, else (e.g. 35
    K-quant blocks a row over 2 ranks) the float32 slice of the dequantized weight, which
    the quantized products equal."""
    out_features, in_features = weight.shape
    assert weight.shape[dim] % world_size == 0, (weight.shape, dim, world_size)
    blocks_per_row = weight.bytes_per_row // block_format(weight.ggml_type).bytes_per_block
    if dim == 0:
        rows = weight.blocks.chunk(world_size, dim=0)[rank].clone()
        return QuantizedWeight(weight.ggml_type, (out_features // world_size, in_features), rows)
    if blocks_per_row % world_size == 0:
        cols = weight.blocks.chunk(world_size, dim=1)[rank].contiguous()
        return QuantizedWeight(weight.ggml_type, (out_features, in_features // world_size), cols)
    return weight.dequantize().chunk(world_size, dim=1)[rank].contiguous()


def _shard_bias(proj: nn.Linear, dim: int, rank: int, world_size: int) -> None:
    if proj.bias is not None:
        bias = proj.bias.detach()
        if dim == 0:
            bias = bias.chunk(world_size)[rank].clone()
        elif rank != 0:
            bias = torch.zeros_like(bias)
        proj.bias = nn.Parameter(bias, requires_grad=False)


def _all_reduce_hook(
    group: dist.ProcessGroup | None,
) -> Callable[[nn.Module, object, torch.Tensor], torch.Tensor]:
    def hook(_module: nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
        # [tokens, hidden] partial sums of a row-parallel projection -> the full output
        if not output.is_contiguous():
            output = output.contiguous()
        dist.all_reduce(output, op=dist.ReduceOp.SUM, group=group)
        return output

    return hook
