"""Export and import of a session's KV cache as snapshot chunks (the target's side).

:class:`KvTransfer` reads whole chunks of a session's cache out of a
:class:`~specserve.engine.kv_cache.KVPool` and builds a session's cache from
chunks, in the format of :mod:`specserve.engine.kv_chunks`. It runs on the
target's model thread, like a forward.

An import changes nothing unless it succeeds: every chunk is checked first —
size, chunk size and position, layout, model fingerprint, and its key against
the key recomputed from the tokens given, and its digest (the export's, over key
and data: :func:`~specserve.engine.kv_chunks.chunk_digest`) recomputed from its
data — then blocks are reserved (a full
budget raises :class:`~specserve.engine.errors.KVBudgetExceeded` before anything
moved), and only then is the K/V copied in. Status of each refusal:
``InvalidArgument`` for a malformed request or a key that does not match the
tokens, ``FailedPrecondition`` for chunks of another model, dtype or layout, or a
cache shorter than the call assumes or a cache here of other tokens than the
import's, ``NotFound`` for an export of a session not held here.

**Nothing of a session's history is in an error message**: not its token ids, not
how many it holds, not where a caller's tokens first differ from them. A refusal
says which rule the *request* broke and echoes only the request's own numbers, so
a caller who knows a session id learns no more than "these tokens are not what the
cache holds" (the internal token, :mod:`specserve.serving.internal_token`, is what
keeps strangers from asking at all).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.engine.errors import FailedPrecondition, InvalidArgument, NotFound
from specserve.engine.kv_cache import KVPool
from specserve.engine.kv_chunks import (
    KvLayout,
    chain_keys,
    check_chunk_tokens,
    chunk_digest,
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
    digest: bytes = b""  # chunk_digest(key, data) under the deployment's digest key


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
        digest_key: bytes = b"",
    ) -> None:
        """``digest_key``: the key of chunk digests
        (:func:`~specserve.engine.kv_chunks.digest_key_of` of the internal token)."""
        self.pool = pool
        self.digest_key = digest_key
        self.fingerprint = fingerprint
        self.vocab = vocab
        self.max_export_bytes = max_export_bytes
        _, heads, head_dim = pool.k[0].shape
        self.layout = KvLayout(pool.num_layers, heads, head_dim, dtype_name(pool.dtype))

    @classmethod
    def for_model(
        cls,
        model: CausalLM,
        pool: KVPool,
        vocab: int,
        *,
        max_export_bytes: int = DEFAULT_MAX_EXPORT_BYTES,
        digest_key: bytes = b"",
    ) -> KvTransfer:
        """Over ``pool``, with ``model``'s fingerprint (a single-process model only)."""
        fingerprint = model_fingerprint(model, model.config, pool.dtype)
        return cls(
            pool, fingerprint, vocab, max_export_bytes=max_export_bytes, digest_key=digest_key
        )

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
        if self.pool.length(session_id) < len(tokens):
            raise FailedPrecondition(
                f"session {session_id!r}: the cache holds fewer tokens than the "
                f"{len(tokens)} to export; export a shorter prefix"
            )
        if self.pool.tokens(session_id)[: len(tokens)].tolist() != list(tokens):
            raise InvalidArgument(
                f"session {session_id!r}: the {len(tokens)} tokens of the export are not "
                "the ones the cache was computed from; export only the tokens the cache holds"
            )
        keys = chain_keys(self.fingerprint, tokens, chunk_tokens, first=first_chunk)
        out = []
        for i, key in enumerate(keys, start=first_chunk):
            start = i * chunk_tokens
            kv = self.pool.read(session_id, start, start + chunk_tokens)
            data = kv_to_bytes(kv)
            digest = chunk_digest(key, data, self.digest_key)
            out.append(
                KvChunk(key, self.fingerprint, self.layout, start, chunk_tokens, data, digest)
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
                "cache, but this replica holds fewer tokens of it; import from 0"
            )
        if start > 0 and pool.tokens(session_id)[:start].tolist() != list(tokens[:start]):
            raise InvalidArgument(
                f"session {session_id!r}: the tokens before position {start} differ from "
                "the ones this replica's cache was computed from; import from 0"
            )
        if start == 0 and session_id in pool and not self._agrees(session_id, tokens[:end]):
            raise FailedPrecondition(
                f"session {session_id!r}: this replica holds a cache of the session computed "
                "from other tokens than the import's; Release the session first (or "
                "re-prefill) to replace it"
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
            kv = kv_from_bytes(chunk.data, chunk.layout, size)  # the size first: cheap
            if not chunk.digest:
                raise FailedPrecondition(
                    f"{where} carries no digest (an export of an older version); re-prefill instead"
                )
            if not hmac.compare_digest(
                chunk.digest, chunk_digest(chunk.key, chunk.data, self.digest_key)
            ):
                raise InvalidArgument(
                    f"{where}: its digest does not match its data under this deployment's "
                    "key (altered, or exported under another internal token); re-prefill "
                    "instead"
                )
            if not bool(torch.isfinite(kv).all()):
                raise InvalidArgument(
                    f"{where} holds non-finite values (NaN or infinity): K/V a model "
                    "computed are finite; re-prefill instead"
                )
            views.append(kv)
        return views

    def _agrees(self, session_id: str, tokens: Sequence[int]) -> bool:
        """Whether the cache held here and ``tokens`` agree wherever both say a token."""
        held = self.pool.tokens(session_id)
        n = min(len(held), len(tokens))
        return all(h == t or h < 0 for h, t in zip(held[:n], tokens[:n], strict=True))

    def _check_vocab(self, session_id: str, tokens: Sequence[int]) -> None:
        if tokens and (min(tokens) < 0 or max(tokens) >= self.vocab):
            bad = next(t for t in tokens if not 0 <= t < self.vocab)
            raise InvalidArgument(
                f"session {session_id!r}: token id {bad} is outside the vocabulary "
                f"(0..{self.vocab - 1})"
            )
