"""Request bytes held by a replica's calls in flight, against budgets.

A data-plane connection (gRPC stream or socket) is read no further while its calls
in flight hold more request bytes than its budget, or while all of the replica's
calls in flight hold more than the replica's (``--max-in-flight-bytes``); a unary
call past the replica's budget is refused. So no number of clients, however fast
they send, can make a replica hold more than that.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class InFlightBytes:
    """The request bytes of a stream's calls in flight, and a budget: past it the stream
    is read no further (the client's writes wait on the transport's flow control) until
    answers free some; one call always gets in.

    ``replica``: the budget every data-plane stream and socket of the replica shares
    (``--max-in-flight-bytes``). A stream also waits for room there, so many
    connections together cannot make a replica hold more than it either; where the
    replica holds nothing, one call gets in. Thread-safe: the replica's gRPC streams
    hold and free bytes on the server's loop, its socket on the model thread's, and a
    waiter on either loop hears of bytes freed on the other."""

    def __init__(self, budget: int, replica: InFlightBytes | None = None) -> None:
        self.budget = budget
        self.replica = replica
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}  # id() of a call message in flight -> its bytes
        self._total = 0
        self._waiters: list[asyncio.Future[None]] = []  # freed(), on any loop

    @property
    def total(self) -> int:
        """Request bytes held by the calls in flight."""
        return self._total

    def _full(self) -> bool:
        return bool(self._held) and self._total >= self.budget

    def has_room(self) -> bool:
        """Whether a call would get in now (here and in the replica's budget)."""
        return not self._full() and (self.replica is None or self.replica.has_room())

    async def room(self) -> None:
        while self._full():
            await self.freed()
        if self.replica is not None:
            await self.replica.room()

    def freed(self) -> asyncio.Future[None]:
        """A future (on the running loop) done once bytes are next freed here."""
        waiter = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._full():
                self._waiters.append(waiter)
                return waiter
        waiter.set_result(None)  # freed meanwhile
        return waiter

    def try_hold(self, message: Any, size: int) -> bool:
        """:meth:`hold` if there is room now (as :meth:`room` would let it in); False if
        not: for a call whose bytes are already read (a unary call), to refuse it."""
        if not self.has_room():
            return False
        self.hold(message, size)
        return True

    def hold(self, message: Any, size: int) -> None:
        with self._lock:
            self._held[id(message)] = size
            self._total += size
        if self.replica is not None:
            self.replica.hold(message, size)

    def done(self, message: Any) -> None:
        with self._lock:
            self._total -= self._held.pop(id(message), 0)
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.get_loop().call_soon_threadsafe(_wake, waiter)
        if self.replica is not None:
            self.replica.done(message)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
