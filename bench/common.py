"""Shared benchmark utilities: environment report, timing, A/B interleaving, results files.

Machines here are shared and noisy (see BENCHMARKS.md), so every claim is a ratio
measured in one run with the variants interleaved (A B A B ...), each figure the
median of several repetitions after a warm-up. :func:`interleave` does that;
:class:`StreamMeter` gives the memory floor's denominator; :func:`write_results`
puts ``NAME.md`` and ``NAME.json`` under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import multiprocessing
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# CPU flags that decide which kernels can run; reported with every table.
FLAGS_OF_INTEREST = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_bf16",
    "amx_tile",
)


def cpu_model() -> str:
    """The CPU model name (``/proc/cpuinfo`` on Linux, ``platform`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_id() -> str:
    """Family, model and stepping as the (possibly virtual) CPU reports them."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("cpu family", "model", "stepping") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break
    except OSError:
        return "unknown"
    return " ".join(f"{k} {v}" for k, v in fields.items()) or "unknown"


def cpu_flag_set() -> set[str]:
    """Every flag the first CPU of ``/proc/cpuinfo`` reports; empty where there is none
    (not Linux, or no ``flags`` line, as on ARM)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_flags() -> dict[str, bool]:
    """Which of :data:`FLAGS_OF_INTEREST` the CPU reports."""
    flags = cpu_flag_set()
    return {f: f in flags for f in FLAGS_OF_INTEREST}


# The ISA classes a result is filed under (bench.quantized's quantized_<class>), best first.
ISA_CLASSES = ("avx512", "avx2", "baseline")
# torch's CPU capability -> ISA class, where /proc/cpuinfo has no flags to read.
_CAPABILITY_CLASS = {"AVX512": "avx512", "AVX2": "avx2"}


def isa_class(flags: Iterable[str] | str | None = None) -> str:
    """The CPU's ISA class, one of :data:`ISA_CLASSES`: ``"avx512"`` when ``avx512f`` is
    among ``flags``, else ``"avx2"`` when ``avx2`` is, else ``"baseline"``.

    ``flags`` is a set of ``/proc/cpuinfo`` flag names or their space-separated string;
    ``None`` reads this machine's (:func:`cpu_flag_set`), falling back to torch's CPU
    capability where there are none to read.
    """
    if flags is None:
        flags = cpu_flag_set()
        if not flags:
            capability = torch.backends.cpu.get_cpu_capability()
            return _CAPABILITY_CLASS.get(capability, "baseline")
    have = set(flags.split()) if isinstance(flags, str) else set(flags)
    if "avx512f" in have:
        return "avx512"
    return "avx2" if "avx2" in have else "baseline"


# The extensions isa_description names: (/proc/cpuinfo flag, name).
_AVX512_PARTS = (("avx512bw", "BW"), ("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"))
_AMX_PARTS = (("amx_int8", "INT8"), ("amx_bf16", "BF16"))
_AVX2_PARTS = (("fma", "FMA"), ("avx_vnni", "AVX-VNNI"))


def _named(have: set[str], names: Sequence[tuple[str, str]]) -> list[str]:
    return [name for flag, name in names if flag in have]


def isa_description(flags: Iterable[str] | str | None = None) -> str:
    """The CPU's ISA in words, for a table's top line: its class (:func:`isa_class`) with
    the extensions that decide which kernels can run, e.g. ``"AVX-512 (F, BW, VNNI,
    BF16) + AMX (INT8, BF16)"``, ``"AVX2 + FMA (no AVX-512)"``, ``"AVX2 + FMA + AVX-VNNI
    (no AVX-512)"`` or ``"baseline (no AVX2)"``. ``flags`` as for :func:`isa_class`."""
    if flags is None:
        flags = cpu_flag_set()
        if not flags:
            cls = isa_class()
            return {"avx512": "AVX-512", "avx2": "AVX2 (no AVX-512)"}.get(cls, "baseline (no AVX2)")
    have = set(flags.split()) if isinstance(flags, str) else set(flags)
    cls = isa_class(have)
    if cls == "avx512":
        parts = ["F", *_named(have, _AVX512_PARTS)]
        text = f"AVX-512 ({', '.join(parts)})"
        if "amx_tile" in have:
            amx = _named(have, _AMX_PARTS)
            text += " + AMX" + (f" ({', '.join(amx)})" if amx else "")
        return text
    if cls == "avx2":
        return " + ".join(["AVX2", *_named(have, _AVX2_PARTS)]) + " (no AVX-512)"
    return "baseline (no AVX2)"


def load_average() -> tuple[float, float, float] | None:
    """1, 5 and 15 minute load averages, or ``None`` where the OS has none."""
    try:
        return os.getloadavg()
    except OSError:
        return None


class LoadProbe:
    """How much CPU the rest of the machine used while a benchmark ran (Linux).

    Load averages count the benchmark's own threads; this does not: the busy time of
    all CPUs (``/proc/stat``, steal included) minus this process's CPU time, over the
    wall time of all CPUs, between construction and :meth:`others_share`. With
    ``children``, the CPU time of child processes that have exited and been waited
    for (servers the benchmark started and stopped) counts as its own too.
    """

    def __init__(self, *, children: bool = False) -> None:
        self.children = children
        self._start = self._snapshot()

    def _snapshot(self) -> tuple[float, float, float] | None:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + fields[4]  # idle + iowait
        busy = (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")
        own = time.process_time()
        if self.children:
            t = os.times()
            own += t.children_user + t.children_system
        return busy, own, time.monotonic()

    def others_share(self) -> float | None:
        """Fraction of all CPUs' time other processes used since construction."""
        end = self._snapshot()
        if self._start is None or end is None:
            return None
        busy, own, wall = (e - s for e, s in zip(end, self._start, strict=True))
        return max(0.0, (busy - own) / (wall * (os.cpu_count() or 1)))


def environment() -> dict[str, Any]:
    """What a results table must state: CPU, flags, ISA class (:func:`isa_class`, and in
    words), threads, versions, date, load, and the GPU where one is visible."""
    try:
        import transformers

        tf_version: str | None = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cpu_id": cpu_id(),
        "cpu_flags": cpu_flags(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa": isa_class(),
        "isa_description": isa_description(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": tf_version,
        "load_average": load_average(),
        "accelerator": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def environment_md(env: Mapping[str, Any]) -> str:
    """The environment as a markdown bullet list."""
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in env["cpu_flags"].items())
    lines = [
        f"- date: {env['date_utc']}",
        f"- CPU: {env['cpu']} ({env.get('cpu_id', 'unknown')}), {env['logical_cpus']} "
        f"logical CPUs; flags: {flags}",
        f"- torch {env['torch']} (CPU capability {env['torch_cpu_capability']}), "
        f"{env['torch_threads']} threads; transformers {env['transformers']}; "
        f"Python {env['python']}",
    ]
    if env.get("accelerator"):
        lines.append(f"- accelerator: {env['accelerator']} (CUDA {torch.version.cuda})")
    others = env.get("other_processes_cpu_share")
    if others is not None:
        lines.append(
            f"- machine load: other processes used {others:.0%} of the CPUs' time during "
            "the run; absolute speeds move with it, the ratios within the run are the claim"
        )
    return "\n".join(lines)


@dataclass
class Samples:
    """Timings (seconds) of one variant, in the order they were taken."""

    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> tuple[float, float]:
        """Lower and upper quartile: how noisy the median is."""
        if len(self.times) < 2:
            return self.times[0], self.times[0]
        q = statistics.quantiles(self.times, n=4)
        return q[0], q[2]


def time_call(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_time(fn: Callable[[], object], reps: int = 7, warmup: int = 1) -> Samples:
    """``reps`` timings of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return Samples([time_call(fn) for _ in range(reps)])


def interleave(
    variants: Mapping[str, Callable[[], object]],
    reps: int = 7,
    warmup: int = 1,
    after_each: Callable[[str], object] | None = None,
) -> dict[str, Samples]:
    """Time the variants in turn (A B C, A B C, ...), ``reps`` rounds after ``warmup``.

    Interleaving spreads the noise of a shared machine over every variant alike;
    compare medians (or per-round ratios) of the returned samples. ``after_each``
    runs untimed after every call (e.g. to roll a cache back).
    """
    out = {name: Samples() for name in variants}
    for rnd in range(warmup + reps):
        for name, fn in variants.items():
            t = time_call(fn)
            if after_each is not None:
                after_each(name)
            if rnd >= warmup:
                out[name].times.append(t)
    return out


class StreamMeter:
    """Read bandwidth of the current threads over a buffer far larger than any cache.

    ``torch.amax`` over ``nbytes`` of float32: a pure streaming read (``torch.sum``'s
    cascade summation ran ~9% slower than a bare AVX-512 read loop here; ``amax``
    matched the loop). With ``huge_pages`` the buffer asks for 2 MiB pages, like the
    weights after :func:`specserve.engine.hugepages.move_to_huge_pages`; on 4 KiB
    pages the same read was ~40% slower on the machine these benchmarks ran on.
    """

    def __init__(self, nbytes: int = 1 << 30, huge_pages: bool = True) -> None:
        from specserve.engine.hugepages import huge_page_buffer

        raw = huge_page_buffer(nbytes) if huge_pages else torch.empty(nbytes, dtype=torch.uint8)
        self.buffer = raw.view(torch.float32)
        self.buffer.fill_(1.0)  # fault every page in
        self.nbytes = nbytes

    def sample(self, reps: int = 3) -> list[float]:
        """``reps`` bandwidth samples in bytes/s."""
        return [self.nbytes / time_call(self.buffer.amax) for _ in range(reps)]


MODEL_SETTINGS = ("target", "draft", "target_dtype", "draft_dtype", "threads")


def model_settings(args: Any) -> dict[str, Any]:
    """The models a benchmark's ``args`` name (:data:`MODEL_SETTINGS`), as plain data a
    child process can take."""
    return {k: getattr(args, k) for k in MODEL_SETTINGS}


def in_child(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a fresh spawned process that has exited when this returns, so the
    models it loaded (a local loop's) leave memory before a stack loads its own."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def device_name(text: str) -> str:
    """An argparse ``type`` for ``--device``: cpu, cuda or cuda:N (whether or not this
    machine has it), else a usage error with the engine's sentence."""
    from specserve.engine.devices import check_device_name
    from specserve.engine.errors import InvalidArgument

    try:
        return check_device_name(text)
    except InvalidArgument as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_range(text: str) -> list[int]:
    """Numbers on the command line (prompt indices, row counts): ``"0-19"`` -> [0, 1, ...,
    19]; ``"5"`` -> [5]; a comma-separated list of both, ``"1,2,3,5,9"``, ``"1-3,5,9"``
    -> [1, 2, 3, 5, 9], in the order written, a number written twice kept once.

    Raises :class:`ValueError` with a sentence for anything else: an empty text or
    item, a negative number or a word, a range whose end is below its start.
    """
    out: dict[int, None] = {}
    for item in text.split(","):
        lo, dash, hi = (part.strip() for part in item.partition("-"))
        if not (lo.isdecimal() and (hi.isdecimal() if dash else True)):
            raise ValueError(
                f"{text!r} is not a list of numbers and ranges such as 1,2,3,5,9 or 1-3,5,9 "
                f"({item.strip()!r} is neither a number nor a range n-m)"
            )
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"{text!r}: the range {item.strip()} ends below its start")
        out.update(dict.fromkeys(range(first, last + 1)))
    return list(out)


def range_list(text: str) -> list[int]:
    """An argparse ``type`` for an optional list of numbers: ``""`` (or blanks) -> [], else
    :func:`parse_range`; what that refuses is a usage error with its sentence."""
    if not text.strip():
        return []
    try:
        return parse_range(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def reproduce_command(module: str, argv: list[str] | None = None) -> str:
    """The command that re-runs this benchmark from the repository root, with the
    ``SPECSERVE_*`` variables it ran under (the servers it starts read them too)."""
    args = list(sys.argv[1:] if argv is None else argv)
    for i, a in enumerate(args):  # a path of this machine: its last part only
        if i > 0 and args[i - 1] in _PATH_FLAGS:
            args[i] = shlex.quote(Path(a).name)
        elif a.split("=", 1)[0] in _PATH_FLAGS and "=" in a:
            flag, value = a.split("=", 1)
            args[i] = f"{flag}={shlex.quote(Path(value).name)}"
        else:  # quoted so the line runs as printed (a prompt holds spaces and parentheses)
            args[i] = shlex.quote(a)
    settings = [
        f"{k}={shlex.quote(v)}"
        for k, v in sorted(os.environ.items())
        if k.startswith("SPECSERVE_") and not any(w in k for w in _PRIVATE)
    ]
    return " ".join([*settings, ".venv/bin/python", "-m", module, *args])


# Variables that name paths of the machine or carry secrets: never in a results file.
_PRIVATE = ("HOME", "PASSWORD", "URL", "TLS", "FILE")
# Flags whose value is a path of the machine: the reproduce line keeps its last part.
_PATH_FLAGS = ("--logs", "--replay", "--guidellm", "--llama-cpp")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Samples):
        return {"median": obj.median, "times": obj.times}
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, Path):
        return obj.name
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def write_results(name: str, markdown: str, data: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write ``bench/results/NAME.md`` and ``NAME.json``; returns both paths."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    md_path = RESULTS_DIR / f"{name}.md"
    json_path = RESULTS_DIR / f"{name}.json"
    md_path.write_text(markdown.rstrip() + "\n")
    json_path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    return md_path, json_path
