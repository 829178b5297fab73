"""The decoder of every supported family (Llama, Qwen2/3, Mistral, Granite, OLMo 2,
Phi-3, Gemma 2 and 3, Qwen3-MoE, Mixtral; :mod:`specserve.engine.families`) over a
paged KV pool.

One :meth:`CausalLM.forward` call serves a batch of sessions with ragged cache
lengths and a ragged number of new tokens each (a prefill, one token, or k + 1
tokens to verify). New tokens of all sessions are packed into one ``[tokens,
hidden]`` matrix so every projection is a single matrix product; attention reads
each session's keys from the pool through one padded, masked SDPA call per layer.

Memory stays linear in the context: a session with more than
:attr:`CausalLM.prefill_chunk_tokens` new tokens runs them in chunks (each chunk
attends to the cache the earlier ones wrote), and a chunk over a cache longer than
:data:`~specserve.engine.attention.BLOCKED_ABOVE_KEYS` attends in key blocks
(:mod:`specserve.engine.attention`). Forwards of fewer new tokens run exactly as
without either.

The layers are :mod:`specserve.engine.layers`; a family's features are config fields
(:class:`~specserve.engine.config.ModelConfig`), read once here (the embedding and
logit multipliers) and there. Module names follow the Hugging Face checkpoints so
weights load by name. The model knows nothing of tensor parallelism:
:mod:`specserve.engine.tp` shards the projections after loading.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from specserve.engine.config import ModelConfig
from specserve.engine.forward_plan import plan_forward
from specserve.engine.kv_cache import KVPool
from specserve.engine.layer_op import layer_kernels
from specserve.engine.layers import RMSNorm, decoder_layer
from specserve.engine.ops import MAX_KERNEL_ROWS, Weight, linear
from specserve.engine.quant.weight import QuantizedWeight
from specserve.engine.rope import RotaryEmbedding

DEFAULT_PREFILL_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class SeqInput:
    """New tokens of one session for one forward.

    ``token_ids`` are appended after the tokens already cached for the session;
    logits are returned for the last ``num_logits`` of them.
    """

    session_id: str
    token_ids: Sequence[int]
    num_logits: int = 1

    def __post_init__(self) -> None:
        assert len(self.token_ids) > 0, "a forward needs at least one new token"
        assert 0 <= self.num_logits <= len(self.token_ids)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(decoder_layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder plus LM head; :meth:`forward` reads and extends a :class:`KVPool`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg)
        # The sliding layers' RoPE where they differ from the global ones (Gemma 3).
        self.local_rope: RotaryEmbedding | None = None
        self.build_rotary()
        self.compute_dtype: torch.dtype | None = None  # None: the weights' dtype
        # A session's new tokens run in chunks of at most this many (None: in one).
        self.prefill_chunk_tokens: int | None = DEFAULT_PREFILL_CHUNK_TOKENS
        # The head's rows when it scores only some tokens (restrict_head), and their ids.
        self._head_rows: Weight | None = None
        self._head_ids: torch.Tensor | None = None
        # The family's multipliers on the embedded tokens and the logits (None: 1).
        self._embed_scale = None if cfg.embedding_multiplier == 1.0 else cfg.embedding_multiplier
        self._logit_divisor = None if cfg.logits_scaling == 1.0 else cfg.logits_scaling
        # Whether the layers may run as one op each (the Llama layer only).
        self._fusable_layers = cfg.plain_layers
        # Layers whose attention slides where only some do (None: the window, if any,
        # applies to all), and the final logits' soft cap.
        self._sliding = None if cfg.sliding_layers is None else frozenset(cfg.sliding_layers)
        self._softcap = cfg.final_logit_softcapping

    def build_rotary(self) -> None:
        """(Re)build the RoPE tables of the config (off the meta device, after a load)."""
        cfg = self.config
        self.rope = RotaryEmbedding(cfg)
        if cfg.sliding_layers is not None:
            local = replace(cfg, rope_theta=cfg.local_rope_theta or cfg.rope_theta)
            self.local_rope = RotaryEmbedding(replace(local, rope_scaling=None))

    def restrict_head(self, token_ids: Sequence[int] | None) -> None:
        """Score only ``token_ids`` from now on: the LM head multiplies just their rows and
        every other logit is ``-inf`` (probability 0: never argmax, never drawn). For a
        draft model (:mod:`specserve.engine.draft_vocab`); ``None`` scores all again. The
        kept rows are copied (quantized blocks stay blocks)."""
        if token_ids is None:
            self._head_rows = self._head_ids = None
            return
        weight = self.lm_head.weight
        ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=self.device)
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self.config.vocab_size:
            raise ValueError(f"head token ids must be in [0, {self.config.vocab_size})")
        if isinstance(weight, QuantizedWeight):
            blocks = weight.blocks.index_select(0, ids.to(weight.blocks.device)).contiguous()
            rows: Weight = QuantizedWeight(weight.ggml_type, (ids.numel(), weight.shape[1]), blocks)
        else:
            rows = weight.detach().index_select(0, ids).contiguous()
        self._head_rows, self._head_ids = rows, ids

    def decoder_layers(self) -> list[nn.Module]:
        """The decoder layers: one forward each per layer of a model call (what a
        server's progress counter counts, :mod:`specserve.serving.progress`)."""
        return list(self.model.layers)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weight matrices (of those not block-quantized: a quantized
        embedding reports the dtype the others were loaded in)."""
        embed = self.model.embed_tokens
        return embed.weight.dtype if isinstance(embed, nn.Embedding) else embed.dtype

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of activations, norms, biases and the KV cache."""
        return self.compute_dtype or self.dtype

    def compute_in_float32(self) -> None:
        """Keep the weight matrices as they are (bfloat16) and compute in float32.

        Norm weights and biases (vectors, a few KiB) become float32; activations and
        the KV cache are float32; the products read the matrices in their dtype
        (:mod:`specserve.engine.ops`: the CPU kernels widen bfloat16 as they load it).
        On a CPU this halves the bytes a decode step streams against float32 weights
        and rounds only the weights: a (k + 1)-token forward gives the same bits as k + 1
        one-token forwards, as in float32. Call it after any ``.to()``.
        """
        for module in self.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if param.dim() == 1 and param.dtype != torch.float32:
                    setattr(module, name, nn.Parameter(param.float(), requires_grad=False))
        self.compute_dtype = torch.float32

    @property
    def device(self) -> torch.device:
        embed = self.model.embed_tokens
        return embed.weight.device if isinstance(embed, nn.Embedding) else embed.device

    def new_kv_pool(self, budget_bytes: int, block_size: int = 16) -> KVPool:
        """A pool shaped for this model (after any tensor-parallel sharding)."""
        attn = self.model.layers[0].self_attn
        return KVPool(
            num_layers=self.config.num_layers,
            num_kv_heads=attn.k_proj.weight.shape[0] // attn.head_dim,
            head_dim=attn.head_dim,
            budget_bytes=budget_bytes,
            dtype=self.activation_dtype,
            device=self.device,
            block_size=block_size,
        )

    @property
    def head_ids(self) -> torch.Tensor | None:
        """The ids a restricted head scores (:meth:`restrict_head`), ascending; None:
        every id."""
        return self._head_ids

    @torch.inference_mode()
    def forward(
        self, seqs: Sequence[SeqInput], kv: KVPool, *, kept_only: bool = False
    ) -> torch.Tensor:
        """Run the new tokens of every session in ``seqs`` and append their K/V.

        Space must be reserved beforehand (:meth:`KVPool.reserve`). Returns float32
        logits ``[sum(num_logits), vocab]`` in the order of ``seqs``; with ``kept_only``
        and a restricted head, only the kept ids' logits ``[sum(num_logits),
        len(head_ids)]`` (column j is id ``head_ids[j]``; every other logit is ``-inf``),
        without the full rows a caller that needs no other id would fill and scan.

        A session with more than :attr:`prefill_chunk_tokens` new tokens first runs
        its leading tokens alone, a chunk at a time, writing their K/V; the batch's
        forward then holds at most a chunk of it (and at least its ``num_logits``).
        """
        seqs = [self._prefill_head(s, kv) for s in seqs]
        return self._forward(seqs, kv, kept_only)

    def _prefill_head(self, seq: SeqInput, kv: KVPool) -> SeqInput:
        """Run the rows of ``seq`` that no logits are asked of alone (in chunks of
        :attr:`prefill_chunk_tokens` from its first token), where ``seq`` has more rows
        than the CPU kernels take in one forward; return what is left of it (its logit
        rows, or ``seq`` unchanged).

        Batch invariance: past :data:`~specserve.engine.ops.MAX_KERNEL_ROWS` rows torch's
        attention computes a row with bits that depend on the row count. A speculative
        first round verifies a prompt with k drafts appended (k + 1 logit rows), a
        target-only one the prompt (1 logit row): both run the same head, the prompt but
        its last token, in the same chunks, and their logit rows go to the kernels, so
        the KV cache and every logit are the same bits either way."""
        head = len(seq.token_ids) - seq.num_logits
        if len(seq.token_ids) <= MAX_KERNEL_ROWS or head <= 0:
            return seq
        chunk = self.prefill_chunk_tokens or head
        tokens = seq.token_ids
        starts = range(0, head, chunk)
        # With no logit rows, the last chunk stays in the batch (a forward needs a token).
        keep = starts[-1] if seq.num_logits == 0 else head
        for done in starts:
            if done >= keep:
                break
            part = tokens[done : min(done + chunk, head)]
            self._forward([SeqInput(seq.session_id, part, 0)], kv)
        return seq if keep == 0 else SeqInput(seq.session_id, tokens[keep:], seq.num_logits)

    def _forward(
        self, seqs: Sequence[SeqInput], kv: KVPool, kept_only: bool = False
    ) -> torch.Tensor:
        window = self.config.sliding_window if self._sliding is None else None
        plan = plan_forward(seqs, kv, window)
        h = self.model.embed_tokens(plan.token_ids).to(self.activation_dtype)  # [tokens, hidden]
        if self._embed_scale is not None:
            h = h * self._embed_scale
        kern = layer_kernels(h, kv.k[0]) if len(kv.k) and self._fusable_layers else None
        if self._sliding is None:
            for i, layer in enumerate(self.model.layers):
                h = layer(h, plan, self.rope, kv.k[i], kv.v[i], kern)
        else:  # sliding and global layers: a plan and a RoPE each
            local = plan_forward(seqs, kv, self.config.sliding_window)
            local_rope = self.local_rope or self.rope
            for i, layer in enumerate(self.model.layers):
                slides = i in self._sliding
                lp, rope = (local, local_rope) if slides else (plan, self.rope)
                h = layer(h, lp, rope, kv.k[i], kv.v[i], kern)
        for s in seqs:
            kv.advance(s.session_id, len(s.token_ids), s.token_ids)
        h = self.model.norm(h.index_select(0, plan.logit_rows))
        if self._head_rows is None or self._head_ids is None:
            scores = linear(h, self.lm_head.weight).float()  # [rows, vocab]
            if self._logit_divisor is None and self._softcap is None:
                return scores
            return self._scaled(scores)
        scores = self._scaled(linear(h, self._head_rows).float())  # [rows, kept ids]
        if kept_only:
            return scores
        logits = h.new_full(
            (h.shape[0], self.config.vocab_size), float("-inf"), dtype=torch.float32
        )
        return logits.index_copy_(1, self._head_ids, scores)

    def _scaled(self, scores: torch.Tensor) -> torch.Tensor:  # [rows, n] float32
        """``scores`` divided by ``logits_scaling`` (Granite) and soft-capped (Gemma),
        where the family asks for either."""
        if self._logit_divisor is not None:
            scores = scores / self._logit_divisor
        if self._softcap is not None:
            scores = torch.tanh(scores / self._softcap) * self._softcap
        return scores
