"""Export and import of a session's KV cache as snapshot chunks (the target's side).

:class:`KvTransfer` reads whole chunks of a session's cache out of a
:class:`~specserve.engine.kv_cache.KVPool` and builds a session's cache from
chunks, in the format of :mod:`specserve.engine.kv_chunks`. It runs on the
target's model thread, like a forward.

An import changes nothing unless it succeeds: every chunk is checked first —
size, chunk size and position, layout, model fingerprint, and its key against
the key recomputed from the tokens given — then blocks are reserved (a full
budget raises :class:`~specserve.engine.errors.KVBudgetExceeded` before anything
moved), and only then is the K/V copied in. Status of each refusal:
``InvalidArgument`` for a malformed request or a key that does not match the
tokens, ``FailedPrecondition`` for chunks of another model, dtype or layout, or a
cache shorter than the call assumes, ``NotFound`` for an export of a session not
held here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.engine.errors import FailedPrecondition, InvalidArgument, NotFound
from specserve.engine.kv_cache import KVPool
from specserve.engine.kv_chunks import (
    KvLayout,
    chain_keys,
    check_chunk_tokens,
    dtype_name,
    kv_from_bytes,
    kv_to_bytes,
    model_fingerprint,
)
from specserve.engine.model import CausalLM

DEFAULT_MAX_EXPORT_BYTES = 48 << 20  # chunk data per ExportKv answer (under 64 MiB messages)


@dataclass(frozen=True)
class KvChunk:
    """One chunk as it travels and is stored (``specserve.v1.KvChunk``)."""

    key: bytes  # chained hash of the prefix through this chunk
    fingerprint: bytes
    layout: KvLayout
    start: int  # first position: chunk index * tokens
    tokens: int
    data: bytes  # [layers, 2, tokens, kv_heads, head_dim], little-endian


@dataclass(frozen=True)
class ExportInput:
    """One ExportKv call: chunks ``first_chunk ..`` of the prefix ``tokens``."""

    session_id: str
    tokens: list[int]  # committed tokens from position 0 through the last chunk wanted
    chunk_tokens: int
    first_chunk: int


@dataclass(frozen=True)
class ImportInput:
    """One ImportKv call: ``chunks`` from position ``start`` on."""

    session_id: str
    tokens: list[int]  # committed tokens from position 0 through the last chunk
    start: int
    chunks: list[KvChunk]


class KvTransfer:
    """Chunked export and import over one KV pool of one model."""

    def __init__(
        self,
        pool: KVPool,
        fingerprint: bytes,
        vocab: int,
        *,
        max_export_bytes: int = DEFAULT_MAX_EXPORT_BYTES,
    ) -> None:
        self.pool = pool
        self.fingerprint = fingerprint
        self.vocab = vocab
        self.max_export_bytes = max_export_bytes
        _, heads, head_dim = pool.k[0].shape
        self.layout = KvLayout(pool.num_layers, heads, head_dim, dtype_name(pool.dtype))

    @classmethod
    def for_model(cls, model: CausalLM, pool: KVPool, vocab: int, **kw: int) -> KvTransfer:
        """Over ``pool``, with ``model``'s fingerprint (a single-process model only)."""
        return cls(pool, model_fingerprint(model, model.config, pool.dtype), vocab, **kw)

    @property
    def bytes_per_token(self) -> int:
        return self.layout.bytes_per_token

    # -- export ----------------------------------------------------------------------

    def export(
        self, session_id: str, tokens: Sequence[int], chunk_tokens: int, first_chunk: int
    ) -> list[KvChunk]:
        """Chunks ``first_chunk .. len(tokens) / chunk_tokens - 1`` of a session's cache.

        ``tokens`` are the session's committed tokens from position 0 through the last
        chunk; they name the chunks, so they must be the tokens the cache was computed
        from (InvalidArgument naming the first position that differs otherwise).
        """
        check_chunk_tokens(chunk_tokens)
        count, rest = divmod(len(tokens), chunk_tokens)
        if count == 0 or rest:
            raise InvalidArgument(
                f"session {session_id!r}: export tokens must be whole chunks of "
                f"{chunk_tokens}, got {len(tokens)}"
            )
        if first_chunk >= count:
            raise InvalidArgument(
                f"session {session_id!r}: first_chunk {first_chunk} is past the last of "
                f"the {count} chunks the tokens cover"
            )
        self._check_vocab(session_id, tokens)
        size = (count - first_chunk) * chunk_tokens * self.bytes_per_token
        if size > self.max_export_bytes:
            fit = max(1, self.max_export_bytes // (chunk_tokens * self.bytes_per_token))
            raise InvalidArgument(
                f"session {session_id!r}: {count - first_chunk} chunks are {size} bytes, "
                f"more than one answer carries ({self.max_export_bytes}); ask for at most "
                f"{fit} per call"
            )
        if session_id not in self.pool:
            raise NotFound(f"session {session_id!r} has no KV cache on this replica")
        have = self.pool.length(session_id)
        if have < len(tokens):
            raise FailedPrecondition(
                f"session {session_id!r}: the cache holds {have} tokens, fewer than the "
                f"{len(tokens)} to export"
            )
        held = self.pool.tokens(session_id)[: len(tokens)]
        if held.tolist() != list(tokens):
            at = next(i for i, (a, b) in enumerate(zip(held, tokens, strict=True)) if a != b)
            raise InvalidArgument(
                f"session {session_id!r}: token {at} of the export is {tokens[at]}, but the "
                f"cache at that position was computed from {held[at]}"
                + (" (not known here)" if held[at] < 0 else "")
                + "; export only the tokens the cache holds"
            )
        keys = chain_keys(self.fingerprint, tokens, chunk_tokens, first=first_chunk)
        out = []
        for i, key in enumerate(keys, start=first_chunk):
            start = i * chunk_tokens
            kv = self.pool.read(session_id, start, start + chunk_tokens)
            out.append(
                KvChunk(key, self.fingerprint, self.layout, start, chunk_tokens, kv_to_bytes(kv))
            )
        self.pool.alloc.touch(session_id)
        return out

    # -- import ----------------------------------------------------------------------

    def import_(
        self, session_id: str, tokens: Sequence[int], start: int, chunks: Sequence[KvChunk]
    ) -> int:
        """Build the session's cache from ``chunks`` (from position ``start`` on) and
        return the tokens it holds now; see the module docstring for refusals."""
        views = self.check(session_id, tokens, start, chunks)
        end = start + sum(c.tokens for c in chunks)
        pool = self.pool
        have = pool.length(session_id) if session_id in pool else 0
        if start > 0 and (session_id not in pool or have < start):
            raise FailedPrecondition(
                f"session {session_id!r}: an import from position {start} continues a "
                f"cache, but this replica holds {have} tokens of it; import from 0"
            )
        if start > 0 and pool.tokens(session_id)[:start].tolist() != list(tokens[:start]):
            raise InvalidArgument(
                f"session {session_id!r}: the tokens before position {start} differ from "
                "the ones this replica's cache was computed from; import from 0"
            )
        pool.reserve({session_id: max(0, end - have)})  # KVBudgetExceeded: nothing changed
        pos = start
        for kv in views:
            pool.write(session_id, pos, kv)
            pos += kv.shape[2]
        pool.set_length(session_id, end)
        pool.set_tokens(session_id, tokens[:end])
        return end

    def check(
        self, session_id: str, tokens: Sequence[int], start: int, chunks: Sequence[KvChunk]
    ) -> list[torch.Tensor]:
        """Validate an import without touching the pool; the chunks' data as tensors."""
        if not chunks:
            raise InvalidArgument(f"session {session_id!r}: an import needs at least one chunk")
        size = chunks[0].tokens
        check_chunk_tokens(size)
        if start % size:
            raise InvalidArgument(
                f"session {session_id!r}: start {start} is not a multiple of the chunk size {size}"
            )
        end = start + len(chunks) * size
        if len(tokens) < end:
            raise InvalidArgument(
                f"session {session_id!r}: the chunks cover positions up to {end} but only "
                f"{len(tokens)} tokens were given"
            )
        self._check_vocab(session_id, tokens[:end])
        keys = chain_keys(self.fingerprint, tokens[:end], size, first=start // size)
        views = []
        for i, (chunk, key) in enumerate(zip(chunks, keys, strict=True)):
            where = f"session {session_id!r}: chunk {i} of the import"
            if chunk.tokens != size or chunk.start != start + i * size:
                raise InvalidArgument(
                    f"{where} covers positions {chunk.start}..{chunk.start + chunk.tokens - 1}"
                    f"; chunks must be consecutive, of {size} positions, from {start}"
                )
            if chunk.fingerprint != self.fingerprint:
                raise FailedPrecondition(
                    f"{where} was computed by another model or dtype (fingerprint "
                    f"{chunk.fingerprint.hex()[:12]}, this replica's "
                    f"{self.fingerprint.hex()[:12]}); re-prefill instead"
                )
            if chunk.layout != self.layout:
                raise FailedPrecondition(
                    f"{where} holds {chunk.layout.describe()}, but this replica caches "
                    f"{self.layout.describe()}"
                )
            if chunk.key != key:
                raise InvalidArgument(
                    f"{where} has key {chunk.key.hex()[:12]}, but the tokens given make "
                    f"{key.hex()[:12]}: it holds the K/V of another token prefix"
                )
            kv = kv_from_bytes(chunk.data, chunk.layout, size)
            if not bool(torch.isfinite(kv).all()):
                raise InvalidArgument(
                    f"{where} holds non-finite values (NaN or infinity): K/V a model "
                    "computed are finite; re-prefill instead"
                )
            views.append(kv)
        return views

    def _check_vocab(self, session_id: str, tokens: Sequence[int]) -> None:
        if tokens and (min(tokens) < 0 or max(tokens) >= self.vocab):
            bad = next(t for t in tokens if not 0 <= t < self.vocab)
            raise InvalidArgument(
                f"session {session_id!r}: token id {bad} is outside the vocabulary "
                f"(0..{self.vocab - 1})"
            )
