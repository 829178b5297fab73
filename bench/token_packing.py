"""Token arrays on the wire: ``repeated int32`` against little-endian int32 ``bytes``.

Times, per message, what one side of a round pays for its token arrays: the
sender builds the message from Python lists and serialises it (**encode**), the
receiver parses it and turns every array into a validated Python list (ids in
``[0, vocab)``; for bytes also ``len % 4 == 0``) (**decode**). Two message shapes
with the same layout as a Verify request's sessions (a session id, ``new_tokens``,
``draft_tokens``) are built in this process from a descriptor, one with
``repeated int32`` fields and one with ``bytes`` fields, so the comparison needs
no change to the real protos. Cases, at the sizes a round sends:

* a batch of 8 and of 32 sessions, one new token and k = 4 drafts each (a decode
  round's Verify; a Propose carries less);
* one session resending a 2,048-token history (``NEEDS_HISTORY``, a failover).

    .venv/bin/python -m bench.token_packing [--reps 20000] [--no-write]

Writes ``bench/results/token_packing.{md,json}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from bench.common import environment, environment_md, reproduce_command, write_results

VOCAB = 151_936
K = 4
CASES = {"batch 8, k 4": (8, 1, K), "batch 32, k 4": (32, 1, K), "history 2048": (1, 2048, 0)}
LITTLE = sys.byteorder == "little"


def _message_classes() -> tuple[Any, Any]:
    """(Repeated, Packed): ``sessions`` of (session_id, new_tokens, draft_tokens)."""
    f = descriptor_pb2.FileDescriptorProto(
        name="bench_token_packing.proto", package="bench", syntax="proto3"
    )
    T = descriptor_pb2.FieldDescriptorProto
    for name, kind, label in (
        ("Repeated", T.TYPE_INT32, T.LABEL_REPEATED),
        ("Packed", T.TYPE_BYTES, T.LABEL_OPTIONAL),
    ):
        session = f.message_type.add(name=f"{name}Session")
        session.field.add(name="session_id", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
        session.field.add(name="new_tokens", number=2, type=kind, label=label)
        session.field.add(name="draft_tokens", number=3, type=kind, label=label)
        request = f.message_type.add(name=name)
        request.field.add(
            name="sessions",
            number=1,
            type=T.TYPE_MESSAGE,
            label=T.LABEL_REPEATED,
            type_name=f".bench.{name}Session",
        )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    get = message_factory.GetMessageClass
    return get(pool.FindMessageTypeByName("bench.Repeated")), get(
        pool.FindMessageTypeByName("bench.Packed")
    )


Repeated, Packed = _message_classes()


def pack(tokens: Sequence[int]) -> bytes:
    a = array("i", tokens)
    if not LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack(raw: bytes) -> list[int]:
    if len(raw) % 4:
        raise ValueError("not whole int32s")
    a = array("i")
    a.frombytes(raw)
    if not LITTLE:
        a.byteswap()
    return a.tolist()


def checked(tokens: list[int]) -> list[int]:
    if tokens and (min(tokens) < 0 or max(tokens) >= VOCAB):
        raise ValueError("out of the vocabulary")
    return tokens


def sessions(batch: int, new: int, drafts: int) -> list[tuple[str, list[int], list[int]]]:
    return [
        (
            f"session-{i:04d}",
            [(7919 * (i + j)) % VOCAB for j in range(new)],
            [(104729 * (i + j + 1)) % VOCAB for j in range(drafts)],
        )
        for i in range(batch)
    ]


def encode_repeated(data: list[tuple[str, list[int], list[int]]]) -> bytes:
    m = Repeated()
    for sid, new, drafts in data:
        m.sessions.add(session_id=sid, new_tokens=new, draft_tokens=drafts)
    return m.SerializeToString()


def encode_packed(data: list[tuple[str, list[int], list[int]]]) -> bytes:
    m = Packed()
    for sid, new, drafts in data:
        m.sessions.add(session_id=sid, new_tokens=pack(new), draft_tokens=pack(drafts))
    return m.SerializeToString()


def decode_repeated(raw: bytes) -> list[tuple[str, list[int], list[int]]]:
    m = Repeated()
    m.ParseFromString(raw)
    return [
        (s.session_id, checked(list(s.new_tokens)), checked(list(s.draft_tokens)))
        for s in m.sessions
    ]


def decode_packed(raw: bytes) -> list[tuple[str, list[int], list[int]]]:
    m = Packed()
    m.ParseFromString(raw)
    return [
        (s.session_id, checked(unpack(s.new_tokens)), checked(unpack(s.draft_tokens)))
        for s in m.sessions
    ]


def time_us(fn: Callable[[], object], reps: int) -> float:
    """Median over 7 batches of ``reps`` calls, microseconds of this thread's CPU per call
    (CPU time, not wall time: on a shared machine a niced run waits for the CPU)."""
    runs = []
    for _ in range(7):
        t0 = time.thread_time_ns()
        for _ in range(reps):
            fn()
        runs.append((time.thread_time_ns() - t0) / reps / 1e3)
    return statistics.median(runs)


def measure(reps: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, shape in CASES.items():
        data = sessions(*shape)
        raw_r, raw_p = encode_repeated(data), encode_packed(data)
        assert decode_repeated(raw_r) == decode_packed(raw_p) == data
        n = max(1, reps // max(1, shape[0] * (shape[1] + shape[2]) // 40))
        row = {
            "repeated_encode_us": time_us(lambda d=data: encode_repeated(d), n),
            "repeated_decode_us": time_us(lambda r=raw_r: decode_repeated(r), n),
            "packed_encode_us": time_us(lambda d=data: encode_packed(d), n),
            "packed_decode_us": time_us(lambda r=raw_p: decode_packed(r), n),
            "repeated_bytes": len(raw_r),
            "packed_bytes": len(raw_p),
        }
        row["repeated_total_us"] = row["repeated_encode_us"] + row["repeated_decode_us"]
        row["packed_total_us"] = row["packed_encode_us"] + row["packed_decode_us"]
        out[name] = row
    return out


def report(rows: dict[str, dict[str, float]], env: dict[str, Any], argv: list[str]) -> str:
    lines = [
        "# Token arrays on the wire: repeated int32 vs packed bytes",
        "",
        "Encode (lists -> message -> bytes) plus decode (bytes -> message -> validated "
        "lists), per message, microseconds of CPU time (median of 7 batches).",
        "",
        "| case | repeated enc | repeated dec | packed enc | packed dec | repeated total "
        "| packed total | saved per message | wire bytes (repeated / packed) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():
        saved = r["repeated_total_us"] - r["packed_total_us"]
        lines.append(
            f"| {name} | {r['repeated_encode_us']:.1f} | {r['repeated_decode_us']:.1f} "
            f"| {r['packed_encode_us']:.1f} | {r['packed_decode_us']:.1f} "
            f"| {r['repeated_total_us']:.1f} | {r['packed_total_us']:.1f} | {saved:+.1f} "
            f"| {int(r['repeated_bytes'])} / {int(r['packed_bytes'])} |"
        )
    lines += [
        "",
        environment_md(env),
        "",
        f"Reproduce: `{reproduce_command('bench.token_packing', argv)}`",
        "",
    ]
    return "\n".join(lines)


def headline(rows: dict[str, dict[str, float]]) -> dict[str, float]:
    """By case: packed bytes' encode + decode time over repeated int32's."""
    return {name: r["packed_total_us"] / r["repeated_total_us"] for name, r in rows.items()}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.token_packing")
    parser.add_argument("--reps", type=int, default=20_000, help="calls per timed batch")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    rows = measure(args.reps)
    env = environment()
    md = report(rows, env, argv)
    print(md)
    if not args.no_write:
        data = {"headline": headline(rows), "cases": rows, "environment": env}
        write_results("token_packing", md, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
