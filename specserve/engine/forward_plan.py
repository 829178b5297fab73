"""The index tensors one model forward shares across its layers (:class:`ForwardPlan`).

A forward packs the new tokens of a ragged batch of sessions into one ``[tokens,
hidden]`` matrix. Every layer then needs the same indices: each token's position,
the pool slot its K/V goes to, each session's slots by position, which session each
token belongs to, and which rows give logits. :func:`plan_forward` builds them once
per forward, on the host, from Python lists and the pool's cached per-session slot
rows (:meth:`~specserve.engine.kv_cache.KVPool.host_slots`), then moves each to the
model's device once: on a GPU a per-session copy or a value read back per layer would
each stall the stream.

The CPU attention kernel (:func:`~specserve.engine.ops.rope_cache_attention`) reads
the causal structure from ``positions`` and ``read_slots`` alone; only the torch path
(a GPU, a chunk past the kernel's rows) needs the dense ``mask`` and the padded
layout's ``pad_index``, so those are built on first use, once per forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
from torch.nn.utils.rnn import pad_sequence


class SessionTokens(Protocol):
    """What a forward needs of one session's input (``SeqInput``)."""

    @property
    def session_id(self) -> str: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def num_logits(self) -> int: ...


class SlotSource(Protocol):
    """What a plan reads of a KV pool (a :class:`~specserve.engine.kv_cache.KVPool`, or a
    tensor-parallel rank's view of one step)."""

    @property
    def device(self) -> torch.device: ...

    def length(self, session_id: str) -> int: ...

    def host_slots(self, session_id: str, start: int, end: int) -> torch.Tensor: ...


@dataclass
class ForwardPlan:
    """Index tensors shared by every layer of one forward, on the model's device."""

    token_ids: torch.Tensor  # [tokens] the packed new tokens
    positions: torch.Tensor  # [tokens] absolute position of each new token
    max_position: int  # max(positions), known without reading the device
    write_slots: torch.Tensor  # [tokens] pool slot each new K/V goes to
    read_slots: torch.Tensor  # [batch, max_len] pool slots of each session's keys
    logit_rows: torch.Tensor  # [sum(num_logits)] packed rows whose logits are returned
    token_session: torch.Tensor  # [tokens] row of read_slots (session) of each packed token
    starts: tuple[int, ...]  # per session: tokens cached before this forward
    news: tuple[int, ...]  # per session: new tokens in this forward
    sliding_window: int | None
    device: torch.device

    @property
    def batch(self) -> int:
        return len(self.news)

    @property
    def max_new(self) -> int:
        return max(self.news)

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """``[batch, 1, max_new, max_len]`` bool, True = attend; None where plain causal
        attention of one new token needs none (one session, no window)."""
        batch, max_new = self.batch, self.max_new
        if batch == 1 and max_new == 1 and self.sliding_window is None:
            return None
        max_len = self.read_slots.shape[1]
        # query i of session b sits at position starts[b] + i; it sees keys at <= that.
        q_pos = torch.tensor(self.starts).unsqueeze(1) + torch.arange(max_new).unsqueeze(0)
        k_pos = torch.arange(max_len).unsqueeze(0).unsqueeze(0)
        allowed = k_pos <= q_pos.unsqueeze(2)  # [batch, max_new, max_len]
        if self.sliding_window is not None:
            allowed &= k_pos > q_pos.unsqueeze(2) - self.sliding_window
        # Padding queries attend to key 0 only so that no softmax row is empty.
        pad_q = torch.arange(max_new).unsqueeze(0) >= torch.tensor(self.news).unsqueeze(1)
        allowed[pad_q] = False
        allowed[..., 0] |= pad_q
        return allowed.unsqueeze(1).to(self.device)

    @cached_property
    def pad_index(self) -> torch.Tensor | None:
        """``[tokens]`` row of each packed token in the padded ``[batch * max_new]``
        layout; None for one session (packed and padded are the same)."""
        if self.batch == 1:
            return None
        max_new = self.max_new
        rows = [b * max_new + i for b, n in enumerate(self.news) for i in range(n)]
        return torch.tensor(rows, dtype=torch.long).to(self.device)


def plan_forward(
    seqs: Sequence[SessionTokens], kv: SlotSource, sliding_window: int | None
) -> ForwardPlan:
    """The plan of one forward of ``seqs`` over ``kv`` (their blocks reserved)."""
    device = kv.device
    starts = tuple(kv.length(s.session_id) for s in seqs)
    news = tuple(len(s.token_ids) for s in seqs)
    ends = [a + n for a, n in zip(starts, news, strict=True)]
    # One tensor (one copy to the device) for the four index lists, cut into views.
    flat: list[int] = [t for s in seqs for t in s.token_ids]
    for a, e in zip(starts, ends, strict=True):
        flat.extend(range(a, e))
    for b, n in enumerate(news):
        flat.extend([b] * n)
    offset = 0
    for s, n in zip(seqs, news, strict=True):
        offset += n
        flat.extend(range(offset - s.num_logits, offset))
    host = torch.tensor(flat, dtype=torch.long)
    tokens = offset
    sizes = [tokens, tokens, tokens, len(flat) - 3 * tokens]
    token_ids, positions, token_session, logit_rows = host.to(device).split(sizes)
    rows = [kv.host_slots(s.session_id, 0, e) for s, e in zip(seqs, ends, strict=True)]
    if len(rows) == 1:  # views of the pool's cached row: no copy
        read_slots = rows[0].unsqueeze(0)
        write_slots = rows[0][starts[0] :]
    else:
        read_slots = pad_sequence(rows, batch_first=True)  # zero-padded [batch, max_len]
        _, host_positions, host_sessions, _ = host.split(sizes)
        write_slots = read_slots[host_sessions, host_positions]
    return ForwardPlan(
        token_ids=token_ids,
        positions=positions,
        max_position=max(ends) - 1,
        write_slots=write_slots.to(device),
        read_slots=read_slots.to(device),
        logit_rows=logit_rows,
        token_session=token_session,
        starts=starts,
        news=news,
        sliding_window=sliding_window,
        device=device,
    )
