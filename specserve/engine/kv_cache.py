"""KV pool: paged per-session key/value storage inside a byte budget.

Two layers, as in nano-vllm's block manager:

* :class:`BlockAllocator` is pure bookkeeping (no torch): a free list of fixed-size
  blocks, one block table and length per session, LRU order, and eviction of idle
  sessions when the budget is full.
* :class:`KVPool` owns the tensors: per layer one flat ``[num_blocks * block_size + 1,
  kv_heads, head_dim]`` buffer for K and one for V, addressed by *slots*
  (``block * block_size + offset``; the last is :attr:`KVPool.scratch_slot`).

A session's cache is the prefix of its tokens that the model has already seen.
``truncate`` rolls it back after a rejection; blocks past the new length return to
the free list at once. ``read`` and ``write`` copy a token range of a session's
K/V out and in, layer-major (what KV snapshot chunks hold, see
:mod:`specserve.engine.kv_chunks`).

The pool also keeps the token id at each cached position (given to
:meth:`KVPool.advance` by the forward that wrote it, or to :meth:`KVPool.set_tokens`
by an import; -1 where unknown), so that an export can check that the tokens a
caller names are the ones the cache was computed from.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from specserve.engine.errors import KVBudgetExceeded, NotFound


@dataclass(frozen=True)
class KVStats:
    """A snapshot of pool use."""

    sessions: int
    tokens: int
    blocks_used: int
    blocks_total: int
    block_size: int
    bytes_per_block: int

    @property
    def bytes_used(self) -> int:
        return self.blocks_used * self.bytes_per_block

    @property
    def bytes_total(self) -> int:
        return self.blocks_total * self.bytes_per_block

    @property
    def bytes_free(self) -> int:
        return self.bytes_total - self.bytes_used


class BlockAllocator:
    """Block tables, lengths and LRU order for sessions; no tensors.

    Invariants (checked by the property tests):
    * every block is either free or owned by exactly one session;
    * a session owns exactly ``ceil(length / block_size)`` blocks after ``truncate``,
      and at least that many otherwise (``reserve`` may allocate ahead);
    * eviction only ever removes sessions that were not protected.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end: low block ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: OrderedDict[str, list[int]] = OrderedDict()  # LRU order: oldest first
        self._lengths: dict[str, int] = {}
        self._versions: dict[str, int] = {}  # per session: the stamp of its table's last change
        self._stamp = 0  # bumped by every table change, so a version never repeats

    # -- queries ---------------------------------------------------------------

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._tables

    def sessions(self) -> list[str]:
        """Session ids, least recently used first."""
        return list(self._tables)

    def length(self, session_id: str) -> int:
        self._require(session_id)
        return self._lengths[session_id]

    def block_table(self, session_id: str) -> list[int]:
        """The session's blocks in position order; do not modify."""
        self._require(session_id)
        return self._tables[session_id]

    def table_version(self, session_id: str) -> int:
        """A number that changes whenever the session's block table does and never
        repeats (not even for a released session's id reused): what cached slot
        rows are checked against."""
        self._require(session_id)
        return self._versions[session_id]

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def total_tokens(self) -> int:
        return sum(self._lengths.values())

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -- mutation --------------------------------------------------------------

    def reserve(self, needs: dict[str, int], protect: Collection[str] = ()) -> list[str]:
        """Make room for ``needs[session] `` more tokens in each session, creating
        sessions that do not exist yet.

        Evicts least recently used sessions outside ``needs`` and ``protect`` when the
        free list is short, and returns their ids. Raises :class:`KVBudgetExceeded`
        (changing nothing) when even eviction cannot make room.
        """
        shortfall = 0
        for sid, n in needs.items():
            assert n >= 0, n
            have = len(self._tables.get(sid, ()))
            shortfall += max(0, self.blocks_needed(self._lengths.get(sid, 0) + n) - have)
        keep = set(needs) | set(protect)
        victims: list[str] = []
        reclaim = len(self._free)
        if shortfall > reclaim:
            for sid in self._tables:  # oldest first
                if sid in keep:
                    continue
                victims.append(sid)
                reclaim += len(self._tables[sid])
                if reclaim >= shortfall:
                    break
        if shortfall > reclaim:
            tokens = sum(needs.values())
            raise KVBudgetExceeded(
                f"the KV cache is full: {tokens} more tokens need {shortfall} blocks of "
                f"{self.block_size} tokens but only {reclaim} of {self.num_blocks} can be "
                "freed; retry later or lower max_new_tokens"
            )
        for sid in victims:
            self.release(sid)
        for sid, n in needs.items():
            if sid not in self._tables:
                self._tables[sid] = []
                self._lengths[sid] = 0
                self._changed(sid)
            table = self._tables[sid]
            target = self.blocks_needed(self._lengths[sid] + n)
            if len(table) < target:
                while len(table) < target:
                    table.append(self._free.pop())
                self._changed(sid)
            self._tables.move_to_end(sid)
        return victims

    def advance(self, session_id: str, n: int) -> None:
        """Record that ``n`` more tokens were written (space must be reserved)."""
        self._require(session_id)
        new_len = self._lengths[session_id] + n
        assert self.blocks_needed(new_len) <= len(self._tables[session_id]), "not reserved"
        self._lengths[session_id] = new_len

    def truncate(self, session_id: str, length: int) -> None:
        """Keep only the first ``length`` tokens; free the blocks past them."""
        self._require(session_id)
        if not 0 <= length <= self._lengths[session_id]:
            raise ValueError(
                f"cannot truncate session {session_id!r} to {length} tokens: "
                f"it holds {self._lengths[session_id]}"
            )
        table = self._tables[session_id]
        keep = self.blocks_needed(length)
        if len(table) > keep:
            while len(table) > keep:
                self._free.append(table.pop())
            self._changed(session_id)
        self._lengths[session_id] = length

    def release(self, session_id: str) -> bool:
        """Drop a session; returns whether it existed."""
        table = self._tables.pop(session_id, None)
        if table is None:
            return False
        self._free.extend(reversed(table))
        del self._lengths[session_id]
        del self._versions[session_id]
        return True

    def touch(self, session_id: str) -> None:
        self._require(session_id)
        self._tables.move_to_end(session_id)

    def _changed(self, session_id: str) -> None:
        self._stamp += 1
        self._versions[session_id] = self._stamp

    def _require(self, session_id: str) -> None:
        if session_id not in self._tables:
            raise NotFound(f"session {session_id!r} has no KV cache on this replica")


def slot_ids(table: Sequence[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Flat slot ids int64 [end - start], on the host, of positions ``[start, end)`` of a
    session whose blocks are ``table``."""
    assert 0 <= start <= end <= len(table) * block_size, "positions past the reserved blocks"
    first, last = start // block_size, -(-end // block_size)
    blocks = torch.tensor(table[first:last], dtype=torch.long)
    # [blocks * block_size] every slot of those blocks, in position order
    grid = (blocks.unsqueeze(1) * block_size + torch.arange(block_size)).view(-1)
    skip = first * block_size
    return grid[start - skip : end - skip]


class KVPool:
    """Paged K/V tensors for every layer, with a :class:`BlockAllocator` in front."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        budget_bytes: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        block_size: int = 16,
    ) -> None:
        elem = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * elem
        num_blocks = budget_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise KVBudgetExceeded(
                f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens "
                f"({self.bytes_per_block} bytes); raise the budget"
            )
        self.num_layers = num_layers
        self.alloc = BlockAllocator(num_blocks, block_size)
        # [slots, kv_heads, head_dim] per layer; the last slot belongs to no block: the
        # scratch slot where a static-shape step writes its padding rows' K/V.
        shape = (num_blocks * block_size + 1, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.device = torch.device(device)
        self.dtype = dtype
        self._tokens: dict[str, array[int]] = {}  # token id per cached position, -1 unknown
        # per session: (table version, [blocks * block_size] slot of every position it holds)
        self._slot_rows: dict[str, tuple[int, torch.Tensor]] = {}

    @classmethod
    def for_model(
        cls, config: object, budget_bytes: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVPool:
        """A pool shaped for a :class:`~specserve.engine.config.ModelConfig`."""
        return cls(
            num_layers=config.num_layers,  # type: ignore[attr-defined]
            num_kv_heads=config.num_kv_heads,  # type: ignore[attr-defined]
            head_dim=config.head_dim,  # type: ignore[attr-defined]
            budget_bytes=budget_bytes,
            dtype=dtype,
            device=device,
        )

    @property
    def block_size(self) -> int:
        return self.alloc.block_size

    @property
    def scratch_slot(self) -> int:
        """A slot past every block, never allocated: where padding rows of a fixed-shape
        step (:mod:`specserve.engine.static_step`) write and read, so they never touch a
        session's cache."""
        return self.alloc.num_blocks * self.alloc.block_size

    def __contains__(self, session_id: object) -> bool:
        return session_id in self.alloc

    def length(self, session_id: str) -> int:
        return self.alloc.length(session_id)

    def reserve(self, needs: dict[str, int], protect: Collection[str] = ()) -> list[str]:
        """See :meth:`BlockAllocator.reserve`; returns the evicted session ids."""
        victims = self.alloc.reserve(needs, protect)
        for sid in victims:
            self._tokens.pop(sid, None)
            self._slot_rows.pop(sid, None)
        return victims

    def slots(self, session_id: str, start: int, end: int) -> torch.Tensor:
        """Flat slot ids int64 [end - start] of positions ``[start, end)`` on the pool's
        device; the blocks must be reserved."""
        return self.host_slots(session_id, start, end).to(self.device)

    def host_slots(self, session_id: str, start: int, end: int) -> torch.Tensor:
        """:meth:`slots` on the host (a forward plans a whole batch there, then copies):
        a view of a row cached until the session's block table changes; do not modify.

        A decode step reads every slot of its session; between two changes of the
        table (a new block every ``block_size`` tokens) it costs a slice, not a
        rebuild from the table."""
        version = self.alloc.table_version(session_id)  # NotFound if absent
        cached = self._slot_rows.get(session_id)
        if cached is None or cached[0] != version:
            table = self.alloc.block_table(session_id)
            row = slot_ids(table, self.alloc.block_size, 0, len(table) * self.alloc.block_size)
            cached = self._slot_rows[session_id] = (version, row)
        assert 0 <= start <= end <= cached[1].shape[0], "positions past the reserved blocks"
        return cached[1][start:end]

    def advance(self, session_id: str, n: int, token_ids: Sequence[int] | None = None) -> None:
        """Record that ``n`` more positions were written, holding ``token_ids`` (if known)."""
        assert token_ids is None or len(token_ids) == n
        self.alloc.advance(session_id, n)
        ids = self._tokens.setdefault(session_id, array("i"))
        ids.extend(token_ids if token_ids is not None else [-1] * n)

    def tokens(self, session_id: str) -> array[int]:
        """The token id at each cached position (-1 where unknown); do not modify."""
        self.alloc.block_table(session_id)  # NotFound if absent
        return self._tokens.setdefault(session_id, array("i"))

    def set_tokens(self, session_id: str, token_ids: Sequence[int]) -> None:
        """Name the token ids of the cached positions (after an import wrote them)."""
        assert len(token_ids) == self.length(session_id)
        self._tokens[session_id] = array("i", token_ids)

    def read(self, session_id: str, start: int, end: int) -> torch.Tensor:
        """A copy of positions ``[start, end)``: ``[layers, 2 (K, V), end - start,
        kv_heads, head_dim]``."""
        assert 0 <= start <= end <= self.length(session_id), (start, end)
        slots = self.slots(session_id, start, end)
        out = torch.empty(
            (self.num_layers, 2, end - start, *self.k[0].shape[1:]),
            dtype=self.dtype,
            device=self.device,
        )
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            torch.index_select(k, 0, slots, out=out[i, 0])
            torch.index_select(v, 0, slots, out=out[i, 1])
        return out

    def write(self, session_id: str, start: int, kv: torch.Tensor) -> None:
        """Copy ``kv`` (``[layers, 2, n, kv_heads, head_dim]``) into positions ``[start,
        start + n)``, whose blocks must be reserved (:meth:`reserve`).

        The length does not change: :meth:`set_length` makes the written positions part
        of the cache once every range is in.
        """
        n = kv.shape[2]
        assert kv.shape == (self.num_layers, 2, n, *self.k[0].shape[1:]), kv.shape
        slots = self.slots(session_id, start, start + n)
        kv = kv.to(device=self.device, dtype=self.dtype)
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k.index_copy_(0, slots, kv[i, 0])
            v.index_copy_(0, slots, kv[i, 1])

    def set_length(self, session_id: str, length: int) -> None:
        """Truncate to ``length``, or advance to it over reserved, written positions."""
        have = self.length(session_id)
        if length <= have:
            self.truncate(session_id, length)
        else:
            self.advance(session_id, length - have)

    def truncate(self, session_id: str, length: int) -> None:
        self.alloc.truncate(session_id, length)
        del self._tokens.setdefault(session_id, array("i"))[length:]

    def release(self, session_id: str) -> bool:
        self._tokens.pop(session_id, None)
        self._slot_rows.pop(session_id, None)
        return self.alloc.release(session_id)

    def stats(self) -> KVStats:
        return KVStats(
            sessions=len(self.alloc.sessions()),
            tokens=self.alloc.total_tokens(),
            blocks_used=self.alloc.used_blocks,
            blocks_total=self.alloc.num_blocks,
            block_size=self.alloc.block_size,
            bytes_per_block=self.bytes_per_block,
        )
