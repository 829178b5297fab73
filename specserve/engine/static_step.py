"""A decode/verify step with static shapes: the forward, the acceptance rule and the
new cache lengths in one function of fixed tensors, for ``torch.compile`` and CUDA graphs.

The eager forward (:meth:`~specserve.engine.model.CausalLM.forward`) plans each call on
the host from Python lists (:mod:`specserve.engine.forward_plan`), and the acceptance
rule (:mod:`specserve.engine.rejection`) reads the target's choices back before it
compares them: on a GPU every round pays the host's time for hundreds of launches. A
:class:`StaticStep` computes the same step over a **bucket** (:class:`Bucket`: a fixed
number of sessions, tokens per session and whether any row is sampled) from two
input tensors whose shapes the bucket fixes (:class:`Layout`):

* ``ints`` int64 ``[sessions, width]``: per session its cached length ``start``, its
  new tokens ``n_new`` (the committed tokens the target has not seen, then the drafts),
  its drafts ``n_draft``, ``top_k``, a coupled flag, the new tokens (padded), the drafts
  (padded with -1), each row's coupled-noise key (:func:`~specserve.engine.coupling.keys`
  of the position it draws), and its slot table: the pool slot of each position up to
  the context the step was built for (:attr:`Layout.context`), the pool's
  :attr:`~specserve.engine.kv_cache.KVPool.scratch_slot` past its reserved blocks;
* ``floats`` float64 ``[sessions, 2]``: temperature and top-p.

and returns int64 ``[sessions, 3]``: accepted drafts, the next token (recovered or
bonus) and the session's cache length after the rollback (committed + accepted). The
step reads the KV pool through the slot tables (index tensors), writes the new K/V at
their slots, and padding rows (a session's rows past ``n_new``, sessions past the
batch) write only the scratch slot. Nothing in it reads a value on the host, calls
``.item()`` or branches on data; every Python branch depends on shapes, dtypes and
devices alone, so one bucket is one graph: ``torch.compile(fullgraph=True)`` traces it
whole (the CPU kernels are torch ops with fakes, :mod:`specserve.engine.kernel_fakes`)
and on CUDA it is captured as a CUDA graph (:mod:`specserve.engine.step_runner`).

The math is the model's own: the same weights and, on a CPU with the engine's kernels,
the same ops (:mod:`specserve.engine.ops`), whose rows have the same bits whatever the
row count, so a static step's tokens equal the eager engine's there. Elsewhere (CUDA,
the kernels off) attention is one masked SDPA over the slot table, the mask made on
the device from the positions. The rollback of a paged pool moves no data: positions
past the accepted prefix are overwritten by the next step's writes, so the step's
third column is all of it on the device; the host's block bookkeeping
(:class:`~specserve.engine.kv_cache.KVPool`) truncates from the counts it reads back.

Greedy and coupled sessions only (:mod:`specserve.engine.static_sampling`); the
rejection rule's draws, logprobs, quantized weights and tensor parallel hooks stay on
the eager path (:meth:`StaticStep.supports`). A draft model's step is the same step
with no drafts (its next token is its draft) and a bucket whose ``support`` makes a
coupled row choose as a draft does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.engine import cpu_kernels, ops, static_sampling
from specserve.engine.kv_cache import KVPool
from specserve.engine.model import CausalLM
from specserve.engine.ops import gate_up_silu, linear, rms_norm, rope_cache_attention

# Session counts a step is built for; a batch runs in the smallest that holds it.
SESSION_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

# Columns of ``ints`` before the per-token ones.
START, N_NEW, N_DRAFT, TOP_K, COUPLED, HEAD = range(6)
TEMPERATURE, TOP_P = 0, 1


@dataclass(frozen=True)
class Bucket:
    """The static shape of one step: sessions, new tokens per session, sampled or not."""

    sessions: int
    tokens: int  # 1 .. k_max + 1
    sampled: bool  # False: every row greedy (no probabilities computed)
    # A draft's step: a coupled row picks among its ``support`` likeliest ids, as a draft
    # draws (draft_sampling); 0: among all, as the target chooses.
    support: int = 0


@dataclass(frozen=True)
class Layout:
    """Where each field sits in a bucket's ``ints`` columns."""

    tokens: int
    context: int  # slot table width: positions the step can address

    @property
    def token_ids(self) -> slice:
        return slice(HEAD, HEAD + self.tokens)

    @property
    def drafts(self) -> slice:
        return slice(HEAD + self.tokens, HEAD + 2 * self.tokens)

    @property
    def keys(self) -> slice:
        return slice(HEAD + 2 * self.tokens, HEAD + 3 * self.tokens)

    @property
    def table(self) -> slice:
        return slice(HEAD + 3 * self.tokens, HEAD + 3 * self.tokens + self.context)

    @property
    def width(self) -> int:
        return HEAD + 3 * self.tokens + self.context


@dataclass(frozen=True)
class _Layer:
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    qkv_bias: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    norm_in: torch.Tensor
    norm_post: torch.Tensor


class StaticStep:
    """The step of one model over one KV pool; call it with a bucket and its inputs."""

    def __init__(self, model: CausalLM, kv: KVPool, context: int, vocab_limit: int) -> None:
        assert StaticStep.supports(model) is None, StaticStep.supports(model)
        cfg = model.config
        if model.device.type == "cpu" and ops.kernels_on():
            # Built (and their fakes registered) now: tracing cannot enter the build's lock.
            cpu_kernels.kernels()
        self.model = model
        self.k_caches, self.v_caches = kv.k, kv.v
        self.scratch = kv.scratch_slot
        self.context = context
        self.vocab_limit = vocab_limit
        self.eps = cfg.rms_norm_eps
        self.head_dim = cfg.head_dim
        self.window = cfg.sliding_window
        self.dtype = model.activation_dtype
        self.inv_freq = model.rope.inv_freq
        self.rope_scale = model.rope.scale
        # [context, head_dim] RoPE tables, the values RotaryEmbedding's grown tables hold.
        cos, sin = model.rope._tables(context, model.device)
        self.cos, self.sin = cos[:context], sin[:context]
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        self.head = model.lm_head.weight
        # A draft's head restricted to some ids (draft_vocab): those rows, the rest -inf.
        self.head_rows, self.head_ids = model._head_rows, model._head_ids
        self.vocab = cfg.vocab_size
        self.layers = [
            _Layer(
                qkv=(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                qkv_bias=(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias),
                o=a.o_proj.weight,
                gate=layer.mlp.gate_proj.weight,
                up=layer.mlp.up_proj.weight,
                down=layer.mlp.down_proj.weight,
                norm_in=layer.input_layernorm.weight,
                norm_post=layer.post_attention_layernorm.weight,
            )
            for layer in model.model.layers
            for a in [layer.self_attn]
        ]

    @staticmethod
    def supports(model: CausalLM) -> str | None:
        """Why ``model`` cannot take static steps, or None when it can."""
        from torch import nn

        cfg = model.config
        if not (
            cfg.plain_layers
            and cfg.embedding_multiplier == 1.0
            and cfg.logits_scaling == 1.0
            and cfg.final_logit_softcapping is None
            and cfg.sliding_layers is None
            and cfg.local_rope_theta is None
        ):
            return f"the {cfg.model_type} family's layer or logit features are not in the step"
        if model._head_rows is not None and not isinstance(model._head_rows, torch.Tensor):
            return "its restricted head is block-quantized"
        for module in model.modules():
            if module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__:
                return "a module carries hooks (tensor parallelism, a counter)"
        if not isinstance(model.model.embed_tokens, nn.Embedding):
            return "its embedding is block-quantized"
        for module in model.modules():
            if isinstance(module, nn.Linear | nn.Embedding) and not isinstance(
                module.__dict__.get("weight", module._parameters.get("weight")), torch.Tensor
            ):
                return "its weights are block-quantized"
        return None

    def layout(self, bucket: Bucket) -> Layout:
        return Layout(bucket.tokens, self.context)

    def inputs(
        self, bucket: Bucket, device: torch.device | None = None, *, pin: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input tensors for ``bucket`` (on the model's device unless ``device`` is given;
        ``pin``: in pinned host memory), every session a padding session (:meth:`clear`)."""
        lay = self.layout(bucket)
        device = device or self.embed.device
        ints = torch.empty((bucket.sessions, lay.width), dtype=torch.long, device=device)
        floats = torch.empty((bucket.sessions, 2), dtype=torch.float64, device=device)
        if pin:
            ints, floats = ints.pin_memory(), floats.pin_memory()
        self.clear(bucket, ints, floats)
        return ints, floats

    def clear(self, bucket: Bucket, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """Make every session of ``ints``/``floats`` a padding session: no new tokens, no
        drafts, its slot table all scratch. A step over such inputs writes only the scratch
        slot (what a CUDA graph is captured over)."""
        lay = self.layout(bucket)
        ints.zero_()
        ints[:, lay.table] = self.scratch
        ints[:, lay.drafts] = -1
        floats.fill_(1.0)

    def __call__(
        self,
        bucket: Bucket,
        ints: torch.Tensor,  # [sessions, layout.width] int64
        floats: torch.Tensor,  # [sessions, 2] float64
    ) -> torch.Tensor:  # [sessions, 3] int64: accepted, next token, new length
        """One step of ``bucket`` (see the module doc). Runs under inference mode."""
        with torch.inference_mode():
            return self._step(bucket, ints, floats)

    def _step(self, bucket: Bucket, ints: torch.Tensor, floats: torch.Tensor) -> torch.Tensor:
        b, t, lay = bucket.sessions, bucket.tokens, self.layout(bucket)
        device = ints.device
        start, n_new, n_draft = ints[:, START], ints[:, N_NEW], ints[:, N_DRAFT]
        table = ints[:, lay.table]  # [b, context]
        j = torch.arange(t, device=device)  # [t]
        real = j[None, :] < n_new[:, None]  # [b, t]
        pos = (start[:, None] + j[None, :]).clamp(max=self.context - 1)  # [b, t]
        write = torch.where(real, table.gather(1, pos), self.scratch).reshape(-1)  # [b * t]
        positions = pos.reshape(-1)  # [b * t]
        session = torch.arange(b, device=device)[:, None].expand(b, t).reshape(-1)  # [b * t]
        index = (positions, write, table.contiguous(), session)

        h = F.embedding(ints[:, lay.token_ids].reshape(-1), self.embed).to(self.dtype)
        for i, layer in enumerate(self.layers):
            h = self._layer(h, layer, self.k_caches[i], self.v_caches[i], index, b, t)

        # Row j of a session's p sits after its committed new tokens: packed row
        # (n_new - n_draft - 1) + j of the session (clamped inside it for padding).
        first = n_new - n_draft - 1  # [b]
        rows = (first[:, None] + j[None, :]).clamp(min=0, max=t - 1)
        rows = (rows + t * torch.arange(b, device=device)[:, None]).reshape(-1)  # [b * t]
        h = rms_norm(h.index_select(0, rows), self.final_norm, self.eps)
        if self.head_rows is None or self.head_ids is None:
            logits = linear(h, self.head).float()
        else:  # the draft vocabulary's rows; every other id -inf (never chosen)
            scored = linear(h, self.head_rows).float()
            logits = scored.new_full((b * t, self.vocab), float("-inf"))
            logits = logits.index_copy(1, self.head_ids, scored)
        logits = logits[:, : self.vocab_limit]  # [b * t, vocab]

        per_row = [x[:, None].expand(b, t).reshape(-1) for x in (ints[:, TOP_K], ints[:, COUPLED])]
        temperature = floats[:, TEMPERATURE].float()[:, None].expand(b, t).reshape(-1)
        top_p = floats[:, TOP_P][:, None].expand(b, t).reshape(-1)
        choice = static_sampling.choices(
            logits,
            bucket.sampled,
            per_row[1] != 0,
            temperature,
            per_row[0],
            top_p,
            ints[:, lay.keys].reshape(-1),
            bucket.support,
        ).view(b, t)  # [b, t] the target's own token at each row

        # Greedy and coupled sessions keep drafts while they equal the target's choice.
        drafts = ints[:, lay.drafts][:, : t - 1]  # [b, t - 1]
        ok = (drafts == choice[:, : t - 1]) & (j[None, : t - 1] < n_draft[:, None])
        accepted = ok.long().cumprod(dim=1).sum(dim=1)  # [b]
        next_token = choice.gather(1, accepted[:, None])[:, 0]  # [b]
        length = start + n_new - n_draft + accepted  # committed + accepted: the rollback
        return torch.stack((accepted, next_token, length), dim=1)

    def _layer(
        self,
        h: torch.Tensor,  # [b * t, hidden]
        w: _Layer,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        index: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        b: int,
        t: int,
    ) -> torch.Tensor:
        positions, write, table, session = index
        x = rms_norm(h, w.norm_in, self.eps)
        # One product each: the kernels' fused ``linears`` returns views of one buffer,
        # which a traced custom op may not (outputs aliasing each other); each row and
        # column has the same bits either way (the kernels' blocking never changes them).
        q, k, v = (linear(x, wt, bias) for wt, bias in zip(w.qkv, w.qkv_bias, strict=True))
        hd = self.head_dim
        q, k, v = q.view(b * t, -1, hd), k.view(b * t, -1, hd), v.view(b * t, -1, hd)
        out = rope_cache_attention(
            q,
            k,
            v,
            positions,
            self.inv_freq,
            self.rope_scale,
            k_cache,
            v_cache,
            write,
            table,
            session,
            self.window,
        )
        if out is None:  # not the CPU kernel's case: torch ops, the same on any device
            out = self._attention(q, k, v, k_cache, v_cache, positions, write, table, b, t)
        h = h + linear(out, w.o)
        return h + linear(gate_up_silu(rms_norm(h, w.norm_post, self.eps), w.gate, w.up), w.down)

    def _attention(
        self,
        q: torch.Tensor,  # [b * t, heads, head_dim]
        k: torch.Tensor,  # [b * t, kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [slots, kv_heads, head_dim]
        v_cache: torch.Tensor,
        positions: torch.Tensor,  # [b * t]
        write: torch.Tensor,  # [b * t]
        table: torch.Tensor,  # [b, context]
        b: int,
        t: int,
    ) -> torch.Tensor:  # [b * t, heads * head_dim]
        """RoPE, the cache write and masked GQA attention over the slot table."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(q.dtype)  # [b * t, 1, hd]
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k_cache.index_copy_(0, write, k.to(k_cache.dtype))
        v_cache.index_copy_(0, write, v.to(v_cache.dtype))
        heads, kv_heads, hd, c = q.shape[1], k.shape[1], self.head_dim, self.context
        q = q.view(b, t, heads, hd).transpose(1, 2)  # [b, heads, t, hd]
        slots = table.reshape(-1)
        keys = k_cache.index_select(0, slots).view(b, c, kv_heads, hd).transpose(1, 2)
        values = v_cache.index_select(0, slots).view(b, c, kv_heads, hd).transpose(1, 2)
        key_pos = torch.arange(c, device=q.device)[None, None, None, :]  # [1, 1, 1, c]
        q_pos = positions.view(b, 1, t, 1)
        mask = key_pos <= q_pos  # [b, 1, t, c]
        if self.window is not None:
            mask = mask & (key_pos > q_pos - self.window)
        out = F.scaled_dot_product_attention(
            q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, enable_gqa=heads != kv_heads
        )
        return out.transpose(1, 2).reshape(b * t, heads * hd)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
