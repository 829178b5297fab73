"""The report of :mod:`bench.kv_restore`: the table, the plot and the markdown.

:func:`table` lays out every context length's medians (re-prefill, restore and its
parts, the target's busy time, save, whether the next token agrees); :func:`plot`
draws the three variants' p50 against the cached length; :func:`markdown` is the
whole results file, with the run's settings and environment.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import environment_md, reproduce_command
from bench.kv_restore_measure import VARIANTS, Length

MODULE = "bench.kv_restore"


def table(rows: list[Length], c: int) -> str:
    head = (
        "| cached L | restored | in Redis | re-prefill p50 | restore p50 | re-prefill / restore "
        "| restore: Redis + ImportKv + tail | target busy: re-prefill / restore | save p50 "
        "| same next token |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = []
    for r in rows:
        p, s = r.times["re-prefill"].median, r.times["restore"].median
        lo, hi = r.times["restore"].spread
        same = f"{sum(r.same_token)}/{len(r.same_token)}"
        if r.logp_diff and max(r.logp_diff) > 0:
            same += f" (max Δ log p {max(r.logp_diff):.1e})"
        lines.append(
            f"| {r.tokens} | {r.chunks} x {c} | {r.chunk_bytes / 2**20:.1f} MiB "
            f"| {_ms(p)} | {_ms(s)} ({_ms(lo)}-{_ms(hi)}) | **{p / s:.2f}x** "
            f"| {_ms(r.get_s.median)} + {_ms(r.import_s.median)} + {_ms(r.tail_s.median)} "
            f"| {_ms(r.busy_prefill_s.median)} / {_ms(r.busy_restore_s.median)} "
            f"| {_ms(r.times['save'].median)} | {same} |"
        )
    return "\n".join([head, *lines])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def plot(rows: list[Length], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [r.tokens for r in rows]
    for name in VARIANTS:
        ax.plot(xs, [r.times[name].median * 1e3 for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("cached tokens L of the session")
    ax.set_ylabel("p50 ms")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(
    rows: list[Length],
    info: dict[str, Any],
    env: dict[str, Any],
    argv: Sequence[str],
    plotted: str | None,
) -> str:
    comp = info["compression"]
    comp_line = (
        f"zlib level 1 over the {info['lengths'][-1]}-token chunks: {comp['ratio']:.3f}x smaller "
        f"at {comp['compress_mb_s']:.0f} MB/s to compress and {comp['decompress_mb_s']:.0f} "
        "MB/s to decompress, so chunks are stored raw."
        if comp
        else "not measured"
    )
    return f"""# KV restore vs re-prefill

How fast a target replica resumes a session whose first L tokens were cached:
re-prefilling all L + {info["tail"]} committed tokens (one `Prefill`) against
restoring the L tokens' saved KV snapshot chunks (Redis reads + `ImportKv` over
loopback gRPC) and then verifying the {info["tail"]}-token tail (one `Verify`). One run,
variants interleaved round by round; p50 over {info["reps"]} rounds after
{info["warmup"]} warm-up round(s), quartiles of the restore in brackets. "Target
busy" is the time the target's model thread spent (the server's `compute_ns`):
during a re-prefill no other session on the replica makes progress. "Save" is
`ExportKv` + `SET` of every chunk (off the round's path in the orchestrator).

Model `{info["model"]}` ({info["dtype"]}), target server with {info["server_threads"]}
torch thread(s); chunks of {info["chunk_tokens"]} tokens, {info["kv_bytes_per_token"]}
K/V bytes per token; ImportKv / ExportKv calls of at most
{info["max_call_bytes"] >> 20} MiB; Redis {info["redis_version"]} on loopback.

{table(rows, info["chunk_tokens"])}

{plotted or ""}

Compression: {comp_line}

Reproduce: `{reproduce_command(MODULE, list(argv))}`

Environment:
{environment_md(env)}
- load average at the start: {env["load_average"]}; CPU share of processes other than
  this benchmark (client, target server, Redis) during the run: {info["others_cpu_share"]}
"""
