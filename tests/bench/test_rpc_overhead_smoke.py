"""bench.rpc_overhead runs end to end on its stub servers (a few rounds, nothing written).

The stub backends stand in for the real ones, so a change to what the servicers ask
of a backend shows up here rather than as a crash of the benchmark. The results file's
headline is what the README quotes: round overhead p50 keyed by batch size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import rpc_overhead, rpc_stub
from bench.round_transport import orchestrator_transport, unavailable
from specserve.v1 import target_pb2
from specserve.wire import draft_wire, target_wire
from specserve.wire.common_wire import SessionLimit


def test_a_short_run_measures_every_batch_size_and_the_references(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    written: dict[str, Any] = {}

    def capture(name: str, markdown: str, data: dict[str, Any]) -> tuple[Path, Path]:
        written.update(name=name, data=data)
        return Path("unused.md"), Path("unused.json")

    monkeypatch.setattr(rpc_overhead, "write_results", capture)
    argv = ["--models", "stub", "--rounds", "3", "--warmup", "1"]
    assert rpc_overhead.main(argv) == 0
    md = capsys.readouterr().out
    transport = orchestrator_transport()
    for batch in rpc_overhead.BATCHES:
        assert f"\n| {batch} | unary | **" in md  # unary is always measured
        assert f"\n| {batch} | {transport} | **" in md
    assert "bare grpc.aio server" in md and "`GetLoad`" in md
    for batch in rpc_overhead.BATCHES:  # and again after --idle-ms asleep
        assert f"\n| {batch} | {transport}, after idle | **" in md
    assert "ms with nothing to do (every process asleep" in md
    for kind, reason in unavailable().items():
        if reason is not None:  # said, not silently skipped
            assert f"The {kind} transport was not measured: {reason}" in md
        else:  # the servers offer it: the round is measured over it too
            for batch in rpc_overhead.BATCHES:
                assert f"\n| {batch} | {kind} | **" in md
    headline = written["data"]["headline"]
    assert written["name"] == "rpc_overhead"
    assert headline["transport"] == transport
    bare = ("bare_unary_round_p50_ms", "bare_stream_round_p50_ms", "bare_socket_round_p50_ms")
    for key in ("round_overhead_p50_ms", *bare):
        assert set(headline[key]) == {"8", "32"}
        assert all(v > 0 for v in headline[key].values())
    assert set(headline["target_met"]) == {"8", "32"}


def test_baseline_runs_another_checkouts_servers_in_the_same_loop(
    capsys: pytest.CaptureFixture[str],
) -> None:
    checkout = str(Path(rpc_overhead.__file__).resolve().parents[1])  # this one, as its own
    argv = ["--models", "stub", "--rounds", "2", "--warmup", "1", "--no-write"]
    assert rpc_overhead.main([*argv, "--baseline", checkout]) == 0
    md = capsys.readouterr().out
    for batch in rpc_overhead.BATCHES:
        assert f"\n| {batch} | unary, baseline | **" in md  # the same traffic as this code's
        assert f"\n| {batch} | socket, baseline | **" in md
        assert f"\n| {batch} | {orchestrator_transport()}, baseline, after idle | **" in md
    assert "Ablation (`--baseline`): this code's socket rounds against the servers of commit" in md
    assert checkout not in md  # named by its commit, not its path


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--idle-ms", "-1"], "--idle-ms must be >= 0"),
        (["--baseline", "no-such-checkout"], "--baseline must name a checkout of specserve"),
        (["--baseline", ".", "--floor"], "not allowed with argument"),
    ],
)
def test_bad_flags_get_the_usage_error(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        rpc_overhead.main(["--models", "stub", "--no-write", *flags])
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_baseline_servers_run_the_other_checkouts_code(tmp_path: Path) -> None:
    """`--baseline CHECKOUT`: the stub servers started from CHECKOUT import CHECKOUT's
    modules, not this one's (``python -m`` puts the working directory first on the path,
    before PYTHONPATH: the servers run from CHECKOUT)."""
    (tmp_path / "bench").mkdir()  # a namespace package, as this checkout's
    (tmp_path / "bench" / "rpc_stub.py").write_text(
        "import pathlib, sys, time\n"  # stands in for the other checkout's stub server
        "pathlib.Path(sys.argv[sys.argv.index('--port-file') + 1]).write_text(__file__)\n"
        "time.sleep(30)\n"
    )
    target, _ = rpc_overhead.servers("stub", 1, str(tmp_path))
    try:
        target.start(timeout_s=60)
    except ValueError:  # the port file holds the module's path, not a port
        pass
    finally:
        target.stop()
    ran = (Path(target.log_path).parent / "port").read_text()
    assert Path(ran.strip()).resolve() == (tmp_path / "bench" / "rpc_stub.py").resolve()


def test_floor_drives_memoized_stub_servers_in_the_same_loop(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    written: dict[str, Any] = {}

    def capture(name: str, markdown: str, data: dict[str, Any]) -> tuple[Path, Path]:
        written.update(data)
        return Path("unused.md"), Path("unused.json")

    monkeypatch.setattr(rpc_overhead, "write_results", capture)
    argv = ["--models", "stub", "--rounds", "2", "--warmup", "1", "--floor"]
    assert rpc_overhead.main(argv) == 0
    md = capsys.readouterr().out
    floor = written["headline"]["floor_round_overhead_p50_ms"]
    assert set(floor) == {"8", "32"} and all(v > 0 for v in floor.values())
    transport = orchestrator_transport()
    for batch in rpc_overhead.BATCHES:
        assert f"\n| {batch} | {transport}, floor | **" in md
    assert "Floor (`--floor`): this code's" in md
    assert "batch 8: " in md.split("Floor (`--floor`)")[1]


def test_memoized_conversion_reuses_the_first_request_of_each_size() -> None:
    calls: list[int] = []

    def convert(request: list[int], vocab: int) -> list[int]:
        calls.append(len(request))
        return list(request)

    once = rpc_stub._memoized(convert, lambda r, *_: len(r))
    assert once([1, 2], 9) == [1, 2]
    assert once([3, 4], 9) == [1, 2]  # the first of its size, reused
    assert once([5], 9) == [5]
    assert calls == [2, 1]


def test_memoize_conversion_replaces_the_servicers_conversions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for module, name in (
        (target_wire, "verify_inputs"),
        (draft_wire, "draft_calls"),
        (draft_wire, "propose_response"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    rpc_stub.memoize_conversion()
    limit = SessionLimit(1 << 20, 1 << 20)

    def request(sid: str) -> target_pb2.VerifyRequest:
        session = target_pb2.VerifySession(session_id=sid, new_tokens=[5])
        return target_pb2.VerifyRequest(sessions=[session])

    first = target_wire.verify_inputs(request("a"), rpc_stub.VOCAB, limit)
    again = target_wire.verify_inputs(request("b"), rpc_stub.VOCAB, limit)
    assert again is first and first[0].session_id == "a"  # the servicer's call, memoized
