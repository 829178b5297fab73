"""Server flags -> one frozen config per process, with SPECSERVE_* environment defaults."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os

import grpc
import pytest

from specserve import cli_servers
from specserve.draft_service import config as draft_config
from specserve.draft_service.server import start as start_draft
from specserve.engine.errors import InvalidArgument
from specserve.serving.cli_args import parse_bytes
from specserve.serving.replica_connection import ReplicaConnection
from specserve.serving.server import ServerOptions
from specserve.serving.socket_call import SocketDial
from specserve.target_service import config as target_config
from specserve.target_service.server import start as start_target
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.services.conftest import run


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SPECSERVE_"):
            monkeypatch.delenv(name)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specserve")
    cli_servers.add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_draft_server_flags() -> None:
    args = parse(
        [
            "draft-server",
            "--model",
            "tiny:1",
            "--kv-budget",
            "16MiB",
            "--dtype",
            "bfloat16",
            "--batch-window-ms",
            "0.5",
            "--threads",
            "1",
            "--max-support",
            "32",
            "--draft-vocab",
            "4096",
        ]
    )
    cfg = draft_config.from_args(args)
    assert (cfg.model, cfg.kv_budget_bytes, cfg.dtype, cfg.max_support, cfg.draft_vocab) == (
        "tiny:1",
        16 << 20,
        "bfloat16",
        32,
        4096,
    )
    assert cfg.server == ServerOptions(batch_window_ms=0.5, threads=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = "other"  # type: ignore[misc]


def test_target_server_flags_and_aliases() -> None:
    cfg = target_config.from_args(parse(["target-server", "--target", "tiny:2", "--port", "7001"]))
    assert cfg.model == "tiny:2" and cfg.server.port == 7001
    assert cfg.kv_budget_bytes == 2 << 30  # the target's default
    assert cfg.dtype == "float32"  # the target's default: exact greedy output


def test_the_target_s_cuda_step_flags() -> None:
    """CUDA graphs on and batch invariance off by default; each flag turns its one over."""
    cfg = target_config.from_args(parse(["target-server", "--target", "tiny:2"]))
    assert cfg.cuda_graphs and not cfg.batch_invariant
    argv = ["target-server", "--target", "tiny:2", "--no-cuda-graphs", "--batch-invariant"]
    cfg = target_config.from_args(parse(argv))
    assert not cfg.cuda_graphs and cfg.batch_invariant


def test_the_draft_s_cuda_graphs_flag() -> None:
    assert draft_config.from_args(parse(["draft-server", "--model", "tiny:1"])).cuda_graphs
    argv = ["draft-server", "--model", "tiny:1", "--no-cuda-graphs"]
    assert not draft_config.from_args(parse(argv)).cuda_graphs


def test_the_draft_serves_bfloat16_weights_by_default() -> None:
    """Half the bytes of a draft step; SPECSERVE_DTYPE and --dtype still choose."""
    cfg = draft_config.from_args(parse(["draft-server", "--model", "tiny:1"]))
    assert cfg.dtype == "bfloat16" and draft_config.DraftServerConfig(model=None).dtype == cfg.dtype
    parser = argparse.ArgumentParser()
    draft_config.add_arguments(parser, {"SPECSERVE_DTYPE": "float32"})
    assert draft_config.from_args(parser.parse_args([])).dtype == "float32"


def test_environment_defaults() -> None:
    env = {
        "SPECSERVE_TARGET": "tiny:5",
        "SPECSERVE_KV_BUDGET": "3GiB",
        "SPECSERVE_BATCH_WINDOW_MS": "0",
        "SPECSERVE_REPLICA_ID": "target-0",
        "SPECSERVE_HOST": "0.0.0.0",
    }
    parser = argparse.ArgumentParser()
    target_config.add_arguments(parser, env)
    cfg = target_config.from_args(parser.parse_args([]))
    assert (cfg.model, cfg.kv_budget_bytes) == ("tiny:5", 3 << 30)
    assert cfg.server.batch_window_ms == 0 and cfg.server.replica_id == "target-0"
    assert cfg.server.host == "0.0.0.0"
    flags = target_config.from_args(parser.parse_args(["--kv-budget", "1GiB"]))
    assert flags.kv_budget_bytes == 1 << 30  # a flag beats the environment


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("64MiB", 64 << 20),
        ("2GiB", 2 << 30),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        ("512k", 512_000),
        ("8 KiB", 8192),
    ],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-5MiB", "0"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


def test_the_data_port_flag() -> None:
    def data_port(env: dict[str, str], argv: list[str]) -> int | None:
        parser = argparse.ArgumentParser()
        target_config.add_arguments(parser, {"SPECSERVE_TARGET": "tiny:1", **env})
        return target_config.from_args(parser.parse_args(argv)).server.data_port

    assert data_port({}, []) == 0  # a free port, reported by GetLoad
    assert data_port({"SPECSERVE_DATA_PORT": "50061"}, []) == 50061
    assert data_port({"SPECSERVE_DATA_PORT": "50061"}, ["--data-port", "off"]) is None
    with pytest.raises(InvalidArgument, match="data_port"):
        data_port({}, ["--data-port", "70000"])
    with pytest.raises(SystemExit):
        data_port({}, ["--data-port", "lots"])


def test_the_replicas_bytes_in_flight_flag() -> None:
    def options(env: dict[str, str], argv: list[str]) -> ServerOptions:
        parser = argparse.ArgumentParser()
        target_config.add_arguments(parser, {"SPECSERVE_TARGET": "tiny:1", **env})
        return target_config.from_args(parser.parse_args(argv)).server

    assert options({}, []).replica_in_flight_bytes == 16 * (64 << 20)  # 16 maximal messages
    assert options({}, ["--max-message-bytes", "2MiB"]).replica_in_flight_bytes == 32 << 20
    assert options({"SPECSERVE_MAX_IN_FLIGHT_BYTES": "1GiB"}, []).replica_in_flight_bytes == 1 << 30
    flag = ["--max-in-flight-bytes", "300MiB"]
    assert options({"SPECSERVE_MAX_IN_FLIGHT_BYTES": "1GiB"}, flag).max_in_flight_bytes == 300 << 20
    with pytest.raises(SystemExit):
        options({}, ["--max-in-flight-bytes", "lots"])
    for name in ("MAX_IN_FLIGHT_BYTES", "MAX_MESSAGE_BYTES", "KV_BUDGET"):
        with pytest.raises(SystemExit):  # a bad environment value is refused as a flag's is
            options({f"SPECSERVE_{name}": "lots"}, [])


def test_a_replicas_socket_and_unary_calls_hold_against_one_budget() -> None:
    """The real draft server: a call over its data-plane socket and a unary Propose are
    both held against the replica's budget while in flight."""

    async def go() -> None:
        options = ServerOptions(max_in_flight_bytes=5 << 20)
        running = await start_draft(draft_config.DraftServerConfig(model=None, server=options))
        held: list[int] = []
        hold = running.in_flight.hold
        running.in_flight.hold = lambda message, size: (held.append(size), hold(message, size))  # type: ignore[method-assign]
        try:
            await asyncio.to_thread(running.executor.ready.wait, 10)
            assert running.in_flight.budget == 5 << 20
            session = draft_pb2.DraftSession(
                session_id="n", new_tokens=[1, 2, 3, 1, 2], k=2, drafter=common_pb2.DRAFTER_NGRAM
            )
            request = draft_pb2.ProposeRequest(sessions=[session])
            async with grpc.aio.insecure_channel(running.address) as channel:
                stream = ReplicaConnection.propose(channel, SocketDial.of(running.address))
                response = await stream.call(request, 10.0)
                await stream.close()
                unary = await draft_pb2_grpc.DraftServiceStub(channel).Propose(request, timeout=10)
                for answer in (response, unary):
                    assert list(answer.results[0].tokens) == [3, 1]
            assert len(held) == 2 and all(size > 0 for size in held)
            assert running.in_flight.total == 0  # both answered: nothing held
        finally:
            await running.stop(0)

    run(go())


def test_a_unary_call_past_the_replicas_budget_is_refused_resource_exhausted() -> None:
    """Unary Propose / Verify / Prefill / ImportKv hold their request against the same budget; with
    the budget held by calls in flight, one is refused (its bytes are read already), and
    served again once they are answered."""

    async def go() -> None:
        options = ServerOptions(max_in_flight_bytes=1 << 20)
        draft = await start_draft(draft_config.DraftServerConfig(model=None, server=options))
        target = await start_target(
            target_config.TargetServerConfig(
                model="tiny:1", kv_budget_bytes=8 << 20, server=options
            )
        )
        try:
            for running in (draft, target):
                await asyncio.to_thread(running.executor.ready.wait, 30)
            session = draft_pb2.DraftSession(
                session_id="n", new_tokens=[1, 2, 3, 1, 2], k=2, drafter=common_pb2.DRAFTER_NGRAM
            )
            propose = draft_pb2.ProposeRequest(sessions=[session])
            prompt = target_pb2.VerifySession(session_id="t", new_tokens=[1, 2, 3])
            verify = target_pb2.VerifyRequest(sessions=[prompt])
            prefill = target_pb2.PrefillRequest(
                sessions=[target_pb2.PrefillSession(session_id="p", tokens=[1, 2, 3])]
            )
            async with (
                grpc.aio.insecure_channel(draft.address) as dc,
                grpc.aio.insecure_channel(target.address) as tc,
            ):
                dstub = draft_pb2_grpc.DraftServiceStub(dc)
                tstub = target_pb2_grpc.TargetServiceStub(tc)
                calls = [
                    (draft, lambda: dstub.Propose(propose)),
                    (target, lambda: tstub.Verify(verify)),
                    (target, lambda: tstub.Prefill(prefill)),
                ]
                for running, call in calls:
                    others = object()  # calls in flight holding the whole budget
                    running.in_flight.hold(others, 1 << 20)
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call()
                    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "--max-in-flight-bytes" in (e.value.details() or "")
                    running.in_flight.done(others)
                    await call()  # room again: served
                    assert running.in_flight.total == 0
                # ImportKv too (chunks of KV: the largest requests a replica takes)
                empty_import = target_pb2.ImportKvRequest(session_id="i", tokens=[1, 2])
                others = object()
                target.in_flight.hold(others, 1 << 20)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await tstub.ImportKv(empty_import)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                target.in_flight.done(others)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await tstub.ImportKv(empty_import)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # read: no chunks
                assert target.in_flight.total == 0
        finally:
            await draft.stop(0)
            await target.stop(0)

    run(go())


def test_invalid_options_are_refused() -> None:
    with pytest.raises(ValueError, match="batch_window_ms"):
        ServerOptions(batch_window_ms=-1)
    with pytest.raises(ValueError, match="max_message_bytes"):
        ServerOptions(max_message_bytes=10)
    with pytest.raises(ValueError, match="max_in_flight_bytes"):
        ServerOptions(max_in_flight_bytes=0)
    with pytest.raises(ValueError, match="dtype"):
        draft_config.DraftServerConfig(model=None, dtype="int8")
    with pytest.raises(ValueError, match="draft_vocab"):
        draft_config.DraftServerConfig(model="tiny:1", draft_vocab=-1)


def test_ngram_only_replica_refuses_the_model_drafter() -> None:
    """No --model: the replica serves n-grams, and says so when asked for the model."""

    async def go() -> None:
        running = await start_draft(draft_config.DraftServerConfig(model=None))
        try:
            await asyncio.to_thread(running.executor.ready.wait, 10)
            async with grpc.aio.insecure_channel(running.address) as channel:
                stub = draft_pb2_grpc.DraftServiceStub(channel)

                def request(drafter: int) -> draft_pb2.ProposeRequest:
                    session = draft_pb2.DraftSession(
                        session_id="n", new_tokens=[1, 2, 3, 1, 2], k=2, drafter=drafter
                    )
                    return draft_pb2.ProposeRequest(sessions=[session])

                response = await stub.Propose(request(common_pb2.DRAFTER_NGRAM))
                assert list(response.results[0].tokens) == [3, 1]
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Propose(request(common_pb2.DRAFTER_MODEL))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "runs no draft model" in (e.value.details() or "")
        finally:
            await running.stop(0)

    run(go())


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["target-server", "--model", "tiny:1", "--batch-window-ms", "5000"], "bad target server"),
        (["draft-server", "--model", "tiny:1", "--batch-window-ms", "-1"], "bad draft server"),
        (["orchestrator", "--target", "127.0.0.1:1", "--admission-window-ms", "5000"], "bad orch"),
    ],
)
def test_a_bad_flag_value_exits_with_one_line_naming_it(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every process's command line: the `specserve` command and the `python -m` entry
    points the manifests and torchrun start say which flag is wrong, exit 2, and load
    nothing (no traceback)."""
    from specserve import cli
    from specserve.draft_service.server import main as draft_main
    from specserve.target_service.server import main as target_main

    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"specserve: {says}") and "\n" not in err and "Traceback" not in err
    flag = argv[-2].lstrip("-").replace("-", "_").removesuffix("_ms")
    assert flag in err
    mains = {"target-server": target_main, "draft-server": draft_main}
    if argv[0] in mains:
        with pytest.raises(SystemExit) as e:
            mains[argv[0]](argv[1:])
        assert e.value.code == 2 and says in capsys.readouterr().err
    else:  # python -m specserve.orchestrator reads sys.argv: run it
        import subprocess
        import sys

        done = subprocess.run(
            [sys.executable, "-m", "specserve.orchestrator", *argv[1:]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr
