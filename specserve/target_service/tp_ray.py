"""Ray launcher for the tensor-parallel target: one actor per rank in a placement group.

For a target that spans nodes (torchrun covers one pod). The server process
starts ``N`` actors, one per bundle of a placement group (``PACK`` by default,
``STRICT_SPREAD`` for one rank per node). The actors form the torch.distributed
group, with a free port on rank 0's node as the rendezvous; each builds the model
and keeps its shard. Rank 0's actor holds a
:class:`~specserve.target_service.tp_worker.TPVerifier`, the others run
:func:`~specserve.target_service.tp_worker.run_worker`.

:class:`RayTPVerifier` is the server's handle: the methods of ``TargetVerifier``,
each one Ray call to rank 0's actor (on top of the step itself). Ray is imported
only here and only when this launcher is used (the ``tp`` extra).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import torch

from specserve.engine.kv_cache import KVStats
from specserve.engine.tp import TPGroupError, init_tp
from specserve.engine.verifier import VerifyInput, VerifyOutcome
from specserve.target_service.tp_config import TPSettings
from specserve.target_service.tp_worker import ModelFactory, TPVerifier, run_worker, shard_model


class RankActor:
    """One rank of the group, run as a Ray actor."""

    def __init__(self, rank: int, world_size: int, num_threads: int | None) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.rank, self.world_size = rank, world_size
        self.verifier: TPVerifier | None = None
        self.worker: tuple[Any, ...] | None = None

    def endpoint(self) -> str:
        """A ``tcp://`` rendezvous on this actor's node (asked of rank 0 only)."""
        import ray.util

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def setup(
        self,
        init_method: str,
        load: ModelFactory,
        kv_budget_bytes: int,
        backend: str,
        settings: TPSettings,
        vocab_limit: int | None,
    ) -> None:
        # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES: its device is cuda:0.
        ctx = init_tp(
            backend,
            settings.timeout_s,
            rank=self.rank,
            world_size=self.world_size,
            init_method=init_method,
        )
        model = shard_model(load, ctx)
        if self.rank == 0:
            self.verifier = TPVerifier(model, kv_budget_bytes, ctx, vocab_limit=vocab_limit)
        else:
            self.worker = (model, kv_budget_bytes, ctx)

    def serve(self) -> None:
        """Workers: mirror rank 0 until it closes the group."""
        assert self.worker is not None
        run_worker(*self.worker)

    # Rank 0: its TPVerifier's interface.

    def info(self) -> tuple[Any, int]:
        assert self.verifier is not None
        return self.verifier.config, self.verifier.vocab_limit

    def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutcome]:
        assert self.verifier is not None
        return self.verifier.verify(inputs)

    def release(self, session_id: str) -> bool:
        assert self.verifier is not None
        return self.verifier.release(session_id)

    def holds(self, session_id: str) -> bool:
        assert self.verifier is not None
        return session_id in self.verifier.kv

    def holding(self, session_ids: list[str]) -> frozenset[str]:
        assert self.verifier is not None
        return self.verifier.holding(session_ids)

    def release_sessions(self, session_ids: list[str]) -> frozenset[str]:
        assert self.verifier is not None
        return self.verifier.release_sessions(session_ids)

    def kv_stats(self) -> KVStats:
        assert self.verifier is not None
        return self.verifier.kv_stats()

    def sessions(self) -> int:
        assert self.verifier is not None
        return self.verifier.sessions()

    def healthy(self) -> bool:
        assert self.verifier is not None
        return self.verifier.healthy()

    def close(self) -> None:
        assert self.verifier is not None
        self.verifier.close()


class _RemoteSessions:
    """``session_id in verifier.kv`` for the pool in rank 0's actor (one Ray call each:
    for a batch, :meth:`RayTPVerifier.holding` asks once)."""

    def __init__(self, owner: RayTPVerifier) -> None:
        self._owner = owner

    def __contains__(self, session_id: object) -> bool:
        return bool(self._owner._call("holds", session_id))


class RayTPVerifier:
    """The server's handle on a Ray-launched group; the interface of ``TargetVerifier``."""

    def __init__(self, actors: list[Any], group: Any, serving: list[Any]) -> None:
        self._actors = actors
        self._group = group
        self._serving = serving  # one pending serve() per worker; done means it left
        self._closed = False
        self.config, self.vocab_limit = self._call("info")

    @property
    def kv(self) -> _RemoteSessions:
        """Membership only: ``session_id in verifier.kv``."""
        return _RemoteSessions(self)

    @property
    def actors(self) -> list[Any]:
        """The rank actors, rank 0 first."""
        return list(self._actors)

    def verify(self, inputs: Sequence[VerifyInput]) -> list[VerifyOutcome]:
        result: list[VerifyOutcome] = self._call("verify", list(inputs))
        return result

    def release(self, session_id: str) -> bool:
        return bool(self._call("release", session_id))

    def release_sessions(self, session_ids: Sequence[str]) -> frozenset[str]:
        """Drop the named sessions' caches in one Ray call; the ids that had one."""
        released: frozenset[str] = self._call("release_sessions", list(session_ids))
        return released

    def holding(self, session_ids: Sequence[str]) -> frozenset[str]:
        """Which of ``session_ids`` rank 0 holds a cache for, in one Ray call."""
        held: frozenset[str] = self._call("holding", list(session_ids))
        return held

    def kv_stats(self) -> KVStats:
        stats: KVStats = self._call("kv_stats")
        return stats

    def sessions(self) -> int:
        return int(self._call("sessions"))

    def healthy(self) -> bool:
        """False once any rank failed or left, or the group was closed."""
        import ray

        if self._closed:
            return False
        done, _ = ray.wait(self._serving, num_returns=len(self._serving), timeout=0)
        try:
            return not done and bool(self._call("healthy"))
        except TPGroupError:
            return False

    def close(self) -> None:
        """Stop the group, then the actors and the placement group."""
        import ray
        from ray.util import remove_placement_group

        if self._closed:
            return
        self._closed = True
        try:
            self._call("close")
            ray.wait(self._serving, num_returns=len(self._serving), timeout=30)
        except TPGroupError:
            pass  # a rank is gone already: kill the rest
        for actor in self._actors:
            ray.kill(actor)
        remove_placement_group(self._group)

    def _call(self, method: str, *args: Any) -> Any:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(getattr(self._actors[0], method).remote(*args))
        except RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None  # the engine's own error (InvalidArgument, TPGroupError...)
            raise
        except RayActorError as e:
            raise TPGroupError(f"rank 0 of the tensor-parallel group died: {e}") from e


def start_ray(
    load: ModelFactory,
    kv_budget_bytes: int,
    settings: TPSettings,
    *,
    vocab_limit: int | None = None,
) -> RayTPVerifier:
    """Start ``settings.world_size`` rank actors in a placement group; return rank 0's handle.

    Joins the cluster at ``settings.ray_address`` unless Ray is already initialised
    in this process. NCCL (one GPU per rank) when the cluster has enough GPUs and
    no backend is set, gloo otherwise.
    """
    import ray
    from ray.util import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=settings.ray_address)
    n = settings.world_size
    backend = settings.backend
    if backend is None:
        backend = "nccl" if ray.cluster_resources().get("GPU", 0) >= n else "gloo"
    gpus = 1 if backend == "nccl" else 0
    bundle = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
    group = placement_group([bundle] * n, strategy=settings.ray_strategy)
    try:
        ray.get(group.ready(), timeout=settings.start_timeout_s)
        remote = ray.remote(num_cpus=1, num_gpus=gpus)(RankActor)
        actors = [
            remote.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                )
            ).remote(rank, n, settings.num_threads)
            for rank in range(n)
        ]
        init_method = ray.get(actors[0].endpoint.remote(), timeout=settings.start_timeout_s)
        ray.get(
            [
                a.setup.remote(init_method, load, kv_budget_bytes, backend, settings, vocab_limit)
                for a in actors
            ],
            timeout=settings.start_timeout_s,
        )
    except BaseException:
        remove_placement_group(group)  # kills the actors scheduled in it
        raise
    serving = [a.serve.remote() for a in actors[1:]]
    return RayTPVerifier(actors, group, serving)
