"""The serving stack the stack benchmarks measure, and one timed batch of streams through it.

:func:`serving_stack` starts a target server, a draft server and one orchestrator per
:class:`OrchestratorSetting` (its own flags and environment; the session store ``args.store``
names: ``embedded`` in each orchestrator, or ``redis``, one throwaway redis-server on
loopback with a database per orchestrator, as a deployment keeps it;
``SPECSERVE_DEVICES`` from :func:`declared_devices` unless the setting names it),
as separate processes on loopback, the way ``specserve up`` starts them. The
orchestrators share the two servers and run one at a time, so a variant whose
setting needs another orchestrator process costs an idle process, not a second
copy of the models. :func:`measure` sends one batch of streaming requests to one
orchestrator and returns what the client saw (:class:`Run`), with the batch rounds by
k cap the orchestrator's metrics port counted during it.

Used by :mod:`bench.concurrency` and :mod:`bench.experiments.policy_ablation`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from specserve.client import AsyncClient
from specserve.devtools.ports import free_port
from specserve.devtools.redis_server import throwaway_redis
from specserve.engine.model_spec import ModelSpec
from specserve.orchestrator.launch import OrchestratorProcess
from specserve.serving.launch import ServerProcess

EMBEDDED, REDIS = "embedded", "redis"
STORES = (EMBEDDED, REDIS)


@dataclass(frozen=True)
class OrchestratorSetting:
    """How one orchestrator process of the stack is started: extra flags and environment."""

    flags: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Stream:
    """One request as the client saw it."""

    sent: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in it)
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0][0] - self.sent

    def latencies(self) -> tuple[list[float], list[float]]:
        """Per-token inter-token latencies (gap / tokens) and the raw gaps between messages."""
        per_token, gaps = [], []
        for (t0, _), (t1, n) in zip(self.arrivals, self.arrivals[1:], strict=False):
            gaps.append(t1 - t0)
            per_token += [(t1 - t0) / n] * n
        return per_token, gaps


@dataclass
class Run:
    """One variant at one concurrency in one repetition."""

    variant: str
    concurrency: int
    rep: int
    wall_s: float
    streams: list[Stream]
    k_caps: dict[int, float] = field(default_factory=dict)  # batch rounds by k cap

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.streams)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


@dataclass
class StackUnderTest:
    orchestrators: dict[str, OrchestratorProcess]  # setting name -> process
    metrics_ports: dict[str, int]
    servers: dict[str, ServerProcess] = field(default_factory=dict)  # role -> process


def declared_devices(args: argparse.Namespace) -> str:
    """What the orchestrators are told about their devices (``SPECSERVE_DEVICES``): the
    environment's value, else ``separate`` with emulated devices and ``shared`` without
    (both servers on this machine's cores). An orchestrator without the setting ignores it.
    """
    return os.environ.get("SPECSERVE_DEVICES") or ("separate" if args.emulate_devices else "shared")


def orchestrator_env(
    args: argparse.Namespace, setting: OrchestratorSetting, redis_url: str | None, db: int
) -> dict[str, str]:
    """The environment of the stack's ``db``-th orchestrator: its declared devices, its
    setting's environment, and with a redis-server (``redis_url``) database ``db`` of it
    (no orchestrator sees another's sessions) unless the setting names a store itself."""
    env = {"SPECSERVE_DEVICES": declared_devices(args), **setting.env}
    if redis_url is not None:
        env.setdefault("SPECSERVE_REDIS_URL", f"{redis_url.rsplit('/', 1)[0]}/{db}")
    return env


def server_flags(args: argparse.Namespace) -> tuple[dict[str, list[str]], str | None]:
    """The target's and the draft's command lines (role -> flags) and the module that runs
    them (None: the servers themselves; ``bench.emulated_device`` with emulated devices).
    ``args.draft_flags`` and ``args.target_flags``, where present, are more flags of
    the draft and the target server;
    ``args.device``, where present and not ``cpu``, the device both servers compute on."""
    threads = ["--threads", str(args.threads)]
    flags = {
        "target": ["--model", args.target, "--dtype", args.target_dtype, *threads],
        "draft": ["--model", args.draft, "--dtype", args.draft_dtype, *threads],
    }
    device = getattr(args, "device", "cpu")
    if device != "cpu":  # a real accelerator: both servers on it
        for role in flags:
            flags[role] += ["--device", device]
    flags["draft"] += list(getattr(args, "draft_flags", ()))
    flags["target"] += list(getattr(args, "target_flags", ()))
    module = None
    if args.emulate_devices:
        module = "bench.emulated_device"
        draft_ms, target_ms = args.emulate_devices
        flags["target"] = ["target", "--forward-ms", str(target_ms), *flags["target"]]
        flags["draft"] = ["draft", "--forward-ms", str(draft_ms), *flags["draft"]]
    return flags, module


@contextmanager
def serving_stack(
    args: argparse.Namespace, settings: Mapping[str, OrchestratorSetting]
) -> Iterator[StackUnderTest]:
    """Target and draft servers and one orchestrator per setting, all serving.

    ``args`` carries the models and how they run: ``target``, ``draft``,
    ``target_dtype``, ``draft_dtype``, ``threads``, ``emulate_devices`` (None or
    (draft ms, target ms) per forward), optionally ``draft_flags``, ``target_timeout_s``,
    ``logs`` (None or a folder for every process's output when the stack stops) and ``store``
    (``embedded``, the default where absent, or ``redis``: see the module docstring).
    """
    flags, module = server_flags(args)
    servers = [ServerProcess(role, flags[role], module=module) for role in ("target", "draft")]
    orchestrators: dict[str, OrchestratorProcess] = {}
    ports = {name: free_port() for name in settings}
    store = getattr(args, "store", EMBEDDED)
    if store not in STORES:
        raise ValueError(f"store must be one of {', '.join(STORES)}, got {store!r}")
    if store == REDIS and len(settings) > 16:
        raise ValueError("one redis-server holds 16 databases: at most 16 orchestrators")
    cleanup = ExitStack()
    try:
        redis_url = cleanup.enter_context(throwaway_redis()) if store == REDIS else None
        for s in servers:  # a loaded machine can take minutes to import torch and bind
            s.start(timeout_s=900)
        common = ["--target", servers[0].address, "--draft", servers[1].address]
        common += ["--target-timeout-s", str(args.target_timeout_s)]
        if not ModelSpec.parse(args.target).is_tiny:
            common += ["--tokenizer", args.target]
        for db, (name, port) in enumerate(ports.items()):
            setting = settings[name]
            env = orchestrator_env(args, setting, redis_url, db)
            # Held before it starts: a start that times out leaves a child to stop below.
            orchestrators[name] = OrchestratorProcess(
                [*common, *setting.flags, "--metrics-port", str(port)], env=env
            )
            orchestrators[name].start(timeout_s=900)
        for p in (*servers, *orchestrators.values()):
            p.wait_serving(timeout_s=900)
        yield StackUnderTest(orchestrators, ports, {s.role: s for s in servers})
    finally:
        for p in (*orchestrators.values(), *servers):
            p.stop()
        cleanup.close()  # the redis-server, after the orchestrators that used it
        if args.logs is not None:  # each process's output (with SPECSERVE_LOG_LEVEL=DEBUG:
            args.logs.mkdir(parents=True, exist_ok=True)  # every round and cap decision)
            for s in servers:
                (args.logs / f"{s.role}.log").write_text(s.output())
            for name, o in orchestrators.items():
                (args.logs / f"orchestrator-{name}.log").write_text(o.output())


def k_cap_rounds(port: int) -> dict[int, float]:
    """Batch rounds by k cap, from an orchestrator's metrics port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    return {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(
            r'^specserve_orchestrator_k_cap_rounds_total\{cap="(\d+)"\} (\S+)$', body, re.M
        )
    }


async def streamed(
    client: AsyncClient,
    prompt: list[int],
    new_tokens: int,
    drafter: str,
    k: int | None,
    ignore_eos: bool,
) -> Stream:
    """One streaming request (greedy; ``k`` None = adaptive), as the client saw it."""
    s = Stream(time.perf_counter())
    deltas = client.stream(
        prompt, max_new_tokens=new_tokens, drafter=drafter, k=k, ignore_eos=ignore_eos
    )
    async for d in deltas:
        if d.token_ids:
            s.arrivals.append((time.perf_counter(), len(d.token_ids)))
            s.tokens += d.token_ids
        if d.usage is not None:
            s.finish = d.finish_reason
            s.drafted, s.accepted = d.usage.drafted_tokens, d.usage.accepted_tokens
            s.rounds = d.usage.rounds
    return s


async def run_streams(
    address: str,
    prompt_list: Sequence[list[int]],
    new_tokens: int,
    drafter: str,
    k: int | None = None,
    ignore_eos: bool = False,
) -> tuple[float, list[Stream]]:
    """Send every prompt at once as a streaming request (greedy; ``k`` None = adaptive;
    ``ignore_eos``: every stream makes ``new_tokens``); wall time from the first request
    to the last token, and what arrived."""
    async with AsyncClient(address, timeout_s=3600) as client:

        async def one(prompt: list[int]) -> Stream:
            return await streamed(client, prompt, new_tokens, drafter, k, ignore_eos)

        t0 = time.perf_counter()
        streams = await asyncio.gather(*(one(p) for p in prompt_list))
        end = max(s.arrivals[-1][0] for s in streams if s.arrivals)
        return end - t0, list(streams)


def measure(
    st: StackUnderTest,
    setting: str,
    name: str,
    rep: int,
    batch: Sequence[list[int]],
    new_tokens: int,
    drafter: str,
    k: int | None = None,
    ignore_eos: bool = False,
) -> Run:
    """One batch through the orchestrator of ``setting``, recorded as variant ``name``."""
    port = st.metrics_ports[setting]
    caps_before = k_cap_rounds(port)
    address = st.orchestrators[setting].address
    wall, streams = asyncio.run(run_streams(address, batch, new_tokens, drafter, k, ignore_eos))
    caps_after = k_cap_rounds(port)
    run = Run(
        name,
        len(batch),
        rep,
        wall,
        streams,
        {
            cap: n - caps_before.get(cap, 0.0)
            for cap, n in caps_after.items()
            if n > caps_before.get(cap, 0.0)
        },
    )
    print(
        f"rep {rep} c={len(batch)} {name}: {run.tokens_per_s:.2f} tok/s "
        f"({run.tokens} tokens in {wall:.1f} s)",
        flush=True,
    )
    return run
