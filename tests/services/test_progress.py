"""The model thread's progress counter: one step per forward of every watched layer; its
CPU clock, read from another thread."""

from __future__ import annotations

import threading
import time

import torch

from specserve.serving.progress import ModelProgress


def test_a_watched_layer_counts_its_forwards_and_keeps_torchs_fast_call_path() -> None:
    layer = torch.nn.Linear(2, 3)
    progress = ModelProgress()
    progress.watch([layer])
    x = torch.ones(1, 2)
    out = layer(x)
    layer(x)
    assert progress.steps == 2
    assert torch.equal(out, torch.nn.functional.linear(x, layer.weight, layer.bias))
    # a forward hook would send every call of the layer down torch's slow call path
    assert not layer._forward_hooks and not layer._forward_pre_hooks


def test_the_cpu_clock_follows_the_attached_thread_only() -> None:
    """Another thread reads the model thread's CPU time: it grows while that thread
    computes, not while it waits, and is 0 before a thread is attached."""
    progress = ModelProgress()
    assert progress.cpu_ns() == 0
    attached, release, spin = threading.Event(), threading.Event(), threading.Event()

    def model_thread() -> None:
        progress.attach_thread()
        attached.set()
        spin.wait()
        deadline = time.thread_time() + 0.05
        while time.thread_time() < deadline:  # 50 ms of CPU time
            pass
        release.wait()

    thread = threading.Thread(target=model_thread)
    thread.start()
    attached.wait()
    waiting = progress.cpu_ns()
    time.sleep(0.1)  # blocked in wait(): no CPU time
    assert progress.cpu_ns() - waiting < 5_000_000
    spin.set()
    time.sleep(0.3)
    assert progress.cpu_ns() - waiting >= 50_000_000
    release.set()
    thread.join()
