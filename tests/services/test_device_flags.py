"""``--device`` on the servers: its default, its dtype, its refusals, and TP following it.

A device this machine lacks is a start-up error: exit code 2, one line, no traceback,
no model loaded. CUDA is faked available (``torch.cuda.is_available``/``device_count``)
where a test needs a machine that has it.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from specserve import cli, cli_servers
from specserve.draft_service import config as draft_config
from specserve.engine.errors import InvalidArgument
from specserve.target_service import config as target_config


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SPECSERVE_"):
            monkeypatch.delenv(name)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specserve")
    cli_servers.add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def draft(*flags: str) -> draft_config.DraftServerConfig:
    return draft_config.from_args(parse(["draft-server", "--model", "tiny:1", *flags]))


def target(*flags: str) -> target_config.TargetServerConfig:
    return target_config.from_args(parse(["target-server", "--model", "tiny:1", *flags]))


def test_cpu_by_default_with_each_servers_cpu_dtype() -> None:
    assert (draft().device, draft().dtype) == ("cpu", "bfloat16")
    assert (target().device, target().dtype) == ("cpu", "float32")


def test_cuda_defaults_both_servers_to_bfloat16(two_gpus: None) -> None:
    assert (draft("--device", "cuda").device, draft("--device", "cuda").dtype) == (
        "cuda",
        "bfloat16",
    )
    assert (target("--device", "cuda:1").device, target("--device", "cuda:1").dtype) == (
        "cuda:1",
        "bfloat16",
    )
    assert target("--device", "cuda", "--dtype", "float32").dtype == "float32"  # a flag wins


def test_the_environment_names_the_device(two_gpus: None) -> None:
    parser = argparse.ArgumentParser()
    draft_config.add_arguments(parser, {"SPECSERVE_DEVICE": "cuda:1", "SPECSERVE_DRAFT": "tiny:1"})
    assert draft_config.from_args(parser.parse_args([])).device == "cuda:1"
    assert draft_config.from_args(parser.parse_args(["--device", "cpu"])).device == "cpu"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--device", "tpu"], "unknown device 'tpu': use cpu, cuda, cuda:N"),
        (["--device", "cuda"], "device 'cuda' needs CUDA, but torch.cuda.is_available() is false"),
        (["--device", "cuda:1"], "needs CUDA"),
    ],
)
@pytest.mark.parametrize("server", ["draft-server", "target-server"])
def test_a_device_this_machine_lacks_exits_2_with_one_line(
    server: str, flags: list[str], says: str, no_gpu: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from specserve.draft_service.server import main as draft_main
    from specserve.target_service.server import main as target_main

    argv = [server, "--model", "tiny:1", *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specserve: ") and says in err
    assert "\n" not in err and "Traceback" not in err
    main = {"draft-server": draft_main, "target-server": target_main}[server]
    with pytest.raises(SystemExit) as e:  # python -m specserve.{draft,target}_service
        main(argv[1:])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_a_cuda_index_past_the_visible_devices_is_refused(two_gpus: None) -> None:
    with pytest.raises(InvalidArgument, match=r"'cuda:2' does not exist: this process sees 2"):
        draft("--device", "cuda:2")


def test_tp_ranks_follow_the_device(two_gpus: None) -> None:
    assert target("--tp", "2").tp.backend == "gloo"
    assert target("--tp", "2", "--device", "cuda").tp.backend == "nccl"
    assert target("--device", "cuda").tp.world_size == 1


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--tp", "2", "--tp-backend", "nccl"], "--tp-backend nccl contradicts --device cpu"),
        (["--tp", "2", "--device", "cuda", "--tp-backend", "gloo"], "gloo contradicts"),
        (["--tp", "2", "--device", "cuda:1"], "each rank takes cuda:<its local rank>"),
    ],
)
def test_a_tp_backend_that_contradicts_the_device_is_refused(
    flags: list[str], says: str, two_gpus: None
) -> None:
    with pytest.raises(InvalidArgument, match=says):
        target(*flags)


def test_a_ray_launcher_checks_only_the_name(no_gpu: None) -> None:
    """Its ranks run on the cluster's GPU nodes, not in this process."""
    cfg = target("--tp", "2", "--tp-launcher", "ray", "--device", "cuda")
    assert (cfg.device, cfg.tp.backend, cfg.dtype) == ("cuda", "nccl", "bfloat16")
    with pytest.raises(InvalidArgument, match="unknown device"):
        target("--tp", "2", "--tp-launcher", "ray", "--device", "gpu")


def test_a_config_built_in_code_checks_the_name() -> None:
    with pytest.raises(InvalidArgument, match="unknown device 'cuda0'"):
        draft_config.DraftServerConfig(model=None, device="cuda0")


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--local", "--target", "tiny:3", "--draft", "tiny:3:noise=0.3"],
        ["up", "--tiny", "--once"],
    ],
    ids=["generate --local", "up"],
)
@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--device", "cuda"], "device 'cuda' needs CUDA"),
        (["--draft-device", "cuda:1"], "device 'cuda:1' needs CUDA"),
        (["--device", "tpu"], "unknown device 'tpu'"),
    ],
)
def test_the_local_loop_and_up_refuse_a_missing_device_before_starting_anything(
    argv: list[str], flags: list[str], says: str, no_gpu: None, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = ["hello"] if argv[0] == "generate" else []
    assert cli.main([*argv, *flags, *prompt]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("specserve: ") and says in err[-1], err
    assert not any("loading" in line or "Traceback" in line for line in err)


def test_generate_local_runs_on_the_cpu_it_names(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--local", "--target", "tiny:3", "--draft", "tiny:3:noise=0.3"]
    assert (
        cli.main([*argv, "--device", "cpu", "--max-new-tokens", "4", "-k", "2", "5 6 7 5 6 7"]) == 0
    )
    err = capsys.readouterr().err
    assert "(float32, cpu)" in err and "(bfloat16, cpu)" in err
