"""bench.load_run: the guidellm command it builds, and (where guidellm is installed) a tiny run.

guidellm pulls a CUDA build of torch, so it is not a dev dependency: the run is
skipped unless ``SPECSERVE_GUIDELLM`` names its executable (a venv of its own).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from bench import load_run


def test_the_command_sends_each_setting_as_the_speculation_object() -> None:
    args = argparse.Namespace(guidellm="guidellm", prompt_tokens=32, output_tokens=16, requests=4)
    cmd = load_run.guidellm_command(args, "http://h:1", "tok", "off", 4, Path("out.json"))
    backend = json.loads(cmd[cmd.index("--backend") + 1])
    assert backend["request_format"] == "/v1/completions"
    assert backend["extras"]["body"]["speculation"] == {"drafter": "none"}
    assert backend["extras"]["body"]["ignore_eos"] is True
    assert json.loads(cmd[cmd.index("--profile") + 1]) == {"kind": "concurrent", "streams": [4]}


@pytest.mark.skipif(not os.environ.get("SPECSERVE_GUIDELLM"), reason="SPECSERVE_GUIDELLM unset")
def test_a_tiny_load_run(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--guidellm", os.environ["SPECSERVE_GUIDELLM"], "--concurrency", "1,2"]
    argv += ["--requests", "2", "--prompt-tokens", "16", "--output-tokens", "8", "--no-write"]
    assert load_run.main(argv) == 0
    md = capsys.readouterr().out
    assert "| 1 | **on / off** |" in md and "| 2 | **on / off** |" in md
    assert "| 2 / 0 |" in md  # every request succeeded
