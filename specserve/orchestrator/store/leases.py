"""Keeping the leases of the sessions this orchestrator generates.

A generating session's record is ACTIVE and carries its orchestrator's lease
(:mod:`specserve.orchestrator.store.keys`). Commits renew it, but a round can take
longer than a lease (a long prefill, a failover), so :class:`LeaseKeeper` also
renews every lease this orchestrator holds each third of the lease, whatever the
rounds are doing. An orchestrator that dies stops renewing: its sessions' leases
run out within one lease, and another orchestrator may then continue, cancel or
close them. A renewal that fails (Redis unreachable) is only logged: the next
commit, retried through the outage, sets the lease again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection

from specserve.engine.errors import EngineError
from specserve.orchestrator.store.session_store import SessionStore

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Renews the leases of ``sessions()`` every third of the store's lease, in the background."""

    def __init__(self, store: SessionStore, sessions: Callable[[], Collection[str]]) -> None:
        self.store = store
        self.sessions = sessions
        self.period_s = store.ttls.lease_s / 3
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start renewing (idempotent; call inside the event loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            ids = list(self.sessions())
            if not ids:
                continue
            try:
                await self.store.renew(ids)
            except EngineError as e:
                log.info("renewing the leases of %d sessions failed: %s", len(ids), e)
