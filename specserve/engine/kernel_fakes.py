"""Fake (meta) implementations of the CPU kernels, so ``torch.compile`` traces through them.

The kernels are torch ops already: ``cpu_kernels.cpp`` declares each schema with
``TORCH_LIBRARY`` (mutated arguments annotated, ``Tensor(a!) k_cache``), and the library
registers their CPU implementations. What ``torch.compile(fullgraph=True)`` still needs
is each op's output shapes without running it: a *fake* implementation, registered
here with :func:`torch.library.register_fake` for the library's namespace once it is
loaded (:func:`register`). An op without one is a graph break under dynamo, and
``fullgraph=True`` raises there; with them a static-shape step
(:mod:`specserve.engine.static_step`) compiles whole with the kernels inside.

Each fake returns empty tensors of the shapes and dtypes the C++ code returns; none
reads a value (the kernels' outputs depend only on input shapes, never on data). The
repack ops are not here: their output width depends on the block type and they run once
at load, never inside a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_registered: set[str] = set()


def register(namespace: str) -> None:
    """Register the fakes for the kernels loaded under ``namespace`` (once per namespace)."""
    if namespace in _registered:
        return
    _registered.add(namespace)
    lib = torch.library

    @lib.register_fake(f"{namespace}::linears")
    def _linears(
        x: torch.Tensor, ws: Sequence[torch.Tensor], bs: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        return [x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32) for w in ws]

    @lib.register_fake(f"{namespace}::gate_up_silu")
    def _gate_up_silu(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], wg.shape[0]), dtype=torch.float32)

    @lib.register_fake(f"{namespace}::q8_linears")
    def _q8_linears(
        x: torch.Tensor,
        ws: Sequence[torch.Tensor],
        types: Sequence[int],
        bs: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        return [x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32) for w in ws]

    @lib.register_fake(f"{namespace}::q8_gate_up_silu")
    def _q8_gate_up_silu(
        x: torch.Tensor, wg: torch.Tensor, tg: int, wu: torch.Tensor, tu: int
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], wg.shape[0]), dtype=torch.float32)

    @lib.register_fake(f"{namespace}::dequantize")
    def _dequantize(blocks: torch.Tensor, type: int, K: int) -> torch.Tensor:
        return blocks.new_empty((blocks.shape[0], K), dtype=torch.float32)

    @lib.register_fake(f"{namespace}::rms_norm")
    def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x, dtype=torch.float32)

    @lib.register_fake(f"{namespace}::rope_cache_attention")
    def _rope_cache_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: object
    ) -> torch.Tensor:
        return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=torch.float32)

    @lib.register_fake(f"{namespace}::coupled_argmax")
    def _coupled_argmax(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return probs.new_empty((probs.shape[0],), dtype=torch.long)

    @lib.register_fake(f"{namespace}::decoder_layer")
    def _decoder_layer(h: torch.Tensor, *rest: object) -> torch.Tensor:
        return torch.empty_like(h)
