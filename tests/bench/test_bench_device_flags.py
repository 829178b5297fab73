"""The benchmarks that run the stack take ``--device``: a bad name is a usage error, the
servers get the flag, and results on a GPU go to their own files."""

from __future__ import annotations

import argparse

import pytest

from bench import concurrency, emulated_gpu, emulated_gpu_report, serving_stack

MODELS = {"target": "tiny:3", "draft": "tiny:3:noise=0.05", "threads": 1}


def stack_args(device: str | None, emulate: tuple[float, float] | None) -> argparse.Namespace:
    """What :func:`serving_stack.server_flags` reads (``device`` None: not set at all)."""
    args = argparse.Namespace(**MODELS, target_dtype="float32", draft_dtype="float32")
    args.emulate_devices = emulate
    if device is not None:
        args.device = device
    return args


@pytest.mark.parametrize("emulate", [None, (2.0, 12.0)])
def test_both_servers_get_the_device(emulate: tuple[float, float] | None) -> None:
    flags, _ = serving_stack.server_flags(stack_args("cuda:1", emulate))
    for role in ("target", "draft"):
        i = flags[role].index("--device")
        assert flags[role][i + 1] == "cuda:1"


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_cpu_run_passes_no_device_flag(device: str | None) -> None:
    flags, _ = serving_stack.server_flags(stack_args(device, None))
    assert all("--device" not in f for f in flags.values())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--device", "cuda", "--emulate-devices", "1,6"], "leave --device out"),
    ],
)
def test_concurrency_refuses_a_bad_device(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        concurrency.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_emulated_gpu_checks_the_device_and_names_its_results(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        emulated_gpu.parse_args(["--device", "npu:0"])
    assert "unknown device 'npu:0'" in capsys.readouterr().err
    args = emulated_gpu.parse_args(["--device", "cuda"])
    setting = emulated_gpu.Setting.parse("2/12")
    assert emulated_gpu.stack_namespace(args, setting).device == "cuda"
    assert emulated_gpu.results_stem("cuda") == "emulated_gpu_cuda"
    assert emulated_gpu.results_stem("cpu") == "emulated_gpu"


def test_emulated_gpu_results_name_the_accelerator_only_on_one() -> None:
    on_gpu = emulated_gpu_report._device({"device": "cuda"}, {"accelerator": "NVIDIA H100"})
    assert any("`cuda` (NVIDIA H100)" in line for line in on_gpu)
    assert emulated_gpu_report._device({"device": "cpu"}, {}) == []
