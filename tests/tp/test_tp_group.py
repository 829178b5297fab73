"""A TP=2 group on CPU (gloo, two spawned ranks on 127.0.0.1) against TP=1.

The ranks are launched with the environment torchrun gives them and join through
``env://``, so this is the torchrun path minus the torchrun binary.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from specserve.engine.verifier import TargetVerifier
from tests.tp import programs
from tests.tp.ranks import LOOPBACK, free_port, run_ranks

pytestmark = pytest.mark.tp


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_tp2_logits_match_tp1(tmp_path: Path, model_type: str) -> None:
    assert run_ranks(programs.logits_program, 2, tmp_path, model_type) == [0, 0]
    saved = torch.load(tmp_path / "logits.pt")
    assert saved["kv_heads"] == (1, 2) and saved["q_rows"] == 32  # half the heads per rank
    for tp, ref in zip(saved["tp"], saved["ref"], strict=True):
        assert tp.shape == ref.shape and tp.dtype == torch.float32
        torch.testing.assert_close(tp, ref, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL TP=2 needs two CUDA devices")
def test_tp2_logits_match_tp1_over_nccl(tmp_path: Path) -> None:
    assert run_ranks(programs.logits_program, 2, tmp_path, "qwen2", "nccl") == [0, 0]
    saved = torch.load(tmp_path / "logits.pt")
    for tp, ref in zip(saved["tp"], saved["ref"], strict=True):
        torch.testing.assert_close(tp, ref, rtol=0, atol=1e-4)  # GPU GEMMs reorder sums


def test_tp2_verifier_greedy_equals_tp1(tp2_greedy: dict[str, Any]) -> None:
    seed, model_type, k = programs.GREEDY_CASE.values()
    tp1 = programs.decode(
        TargetVerifier(programs.load_target(seed, model_type), programs.BUDGET), seed, model_type, k
    )
    assert tp2_greedy["plain"] == tp1["plain"]
    assert tp2_greedy["spec"] == tp1["spec"] == tp1["plain"]
    assert tp2_greedy["spec_drafted"] > 0 and tp2_greedy["spec_accepted"] > 0
    assert tp2_greedy["plain_drafted"] == 0
    assert tp2_greedy["max_batch"] == 3  # sessions were batched through the group
    assert tp2_greedy["blocks_used"] == 0  # every session released on rank 0
    assert "outside the vocabulary" in tp2_greedy["bad_input"]


def test_tp2_ranks_prefill_a_prompt_in_chunks_as_tp1(tmp_path: Path) -> None:
    """The orchestrator's chunks are ordinary Verify calls: rank 0 broadcasts each of
    their forwards, so the ranks chunk alike and decode what one process decodes."""
    from tests.engine.test_chunked_prefill import greedy_after_prefill, prompt

    assert run_ranks(programs.chunked_program, 2, tmp_path, 30.0) == [0, 0]
    tp2 = pickle.loads((tmp_path / "chunked.pkl").read_bytes())
    tp1 = TargetVerifier(programs.load_target(3, "qwen2"), 16 << 20)
    assert tp2["chunked"] == tp2["whole"]
    assert tp2["whole"] == greedy_after_prefill(tp1, "s", prompt(1200, 11), [], 12)


def test_torchrun_launch_decodes_as_the_spawned_group(
    tmp_path: Path, tp2_greedy: dict[str, Any]
) -> None:
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
        *("--master-addr", LOOPBACK, "--master-port", str(free_port())),
        *("-m", "tests.tp.torchrun_program", str(tmp_path)),
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert pickle.loads((tmp_path / "greedy.pkl").read_bytes()) == tp2_greedy


def test_killed_worker_makes_rank0_raise_at_once(tmp_path: Path) -> None:
    timeout_s = 4.0
    codes = run_ranks(programs.kill_program, 2, tmp_path, timeout_s, timeout_s * 1.25, "kill")
    assert codes[0] == 0 and codes[1] == -9
    result = pickle.loads((tmp_path / "kill.pkl").read_bytes())
    assert result["healthy_before"]  # idle past the timeout: the heartbeat kept rank 1 waiting
    assert result["error"] is not None and "tensor-parallel rank" in result["error"]
    assert result["elapsed"] < timeout_s  # a closed socket: no need to wait for the timeout
    assert not result["healthy_after"]
    assert "failed earlier" in result["second_error"] and result["second_elapsed"] < 0.5


def test_frozen_worker_makes_rank0_raise_within_the_timeout(tmp_path: Path) -> None:
    timeout_s = 3.0
    codes = run_ranks(programs.kill_program, 2, tmp_path, timeout_s, 0.0, "stop")
    assert codes[0] == 0 and codes[1] == -9
    result = pickle.loads((tmp_path / "kill.pkl").read_bytes())
    assert result["error"] is not None and "tensor-parallel" in result["error"]
    assert timeout_s * 0.8 < result["elapsed"] < timeout_s + 3
    assert not result["healthy_after"]
