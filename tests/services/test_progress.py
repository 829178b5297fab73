"""The model thread's progress counter: one step per forward of every watched layer."""

from __future__ import annotations

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
