"""Weights on transparent huge pages: faster weight streaming on CPU.

A decode step reads every weight once, ~6 GB for a 1.5B model in float32, and on
4 KiB pages that is 1.5 M TLB misses a token. Backed by 2 MiB pages the same
products ran 5-20% faster here (varying with the machine's load; see
``bench/results/engine_decode.md``) and a plain streaming read 1.6-1.9x faster.

Linux only hands huge pages to memory that asks for them when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (the common
default), and torch's allocator asks only when ``THP_MEM_ALLOC_ENABLE=1`` is set
before it starts. :func:`move_to_huge_pages` does it after loading instead: it
copies the parameters of a model into one ``madvise(MADV_HUGEPAGE)`` anonymous
mapping and points them there. Names, shapes, values and tied weights stay as
they were; only the memory behind them moves. It also turns weights that are
private mappings of the checkpoint files (as safetensors loading leaves them:
faulted in lazily, droppable under memory pressure, at 8-byte offsets) into
resident anonymous memory with every tensor on a 64-byte boundary.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch
from torch import nn

from specserve.engine.quant import QuantizedWeight

log = logging.getLogger(__name__)

_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_ALIGN = 64  # bytes: every tensor starts on a cache line


def huge_pages_available() -> bool:
    """Whether ``madvise(MADV_HUGEPAGE)`` can give this process transparent huge pages."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = _THP_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting


def huge_page_buffer(nbytes: int) -> torch.Tensor:  # [nbytes] uint8
    """A zero-filled byte tensor on memory that asks for huge pages (where available).

    It is an anonymous mapping, not from torch's allocator; the tensor keeps it alive.
    """
    arena = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages_available():
        arena.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(arena, dtype=torch.uint8)[:nbytes]


def move_to_huge_pages(module: nn.Module, min_bytes: int = 1 << 20) -> int:
    """Copy the CPU parameters of ``module`` of at least ``min_bytes`` onto huge pages.

    Returns the bytes moved (0 where huge pages are unavailable). Call it once after
    loading, before serving; the old storage is freed as each tensor moves unless
    something else still holds it. Parameters shared between modules move once.

    The smaller CPU parameters (norms, biases) are copied too, onto torch's own
    memory: safetensors maps each checkpoint file once and every tensor read from
    it is a view of that mapping, so a single bias left on it would keep the whole
    file mapped, and every page the copy read resident beside the copy (7 GB of a
    1.5B float32 target's checkpoint).

    Quantized weights (the ``weight`` of a module that is a ``QuantizedWeight``) move
    too, whatever their size.
    """
    if not huge_pages_available():
        log.info("transparent huge pages unavailable: weights stay on normal pages")
        return 0
    return _move_parameters(module, min_bytes) + _move_quantized(module)


def _move_parameters(module: nn.Module, min_bytes: int) -> int:
    params: dict[int, nn.Parameter] = {}
    small: dict[int, nn.Parameter] = {}
    for p in module.parameters():  # parameters() already yields a shared one once
        if p.device.type == "cpu":
            big = p.numel() * p.element_size() >= min_bytes
            (params if big else small).setdefault(id(p), p)
    with torch.no_grad():
        for p in small.values():
            p.data = p.data.clone()
    if not params:
        return 0
    offsets: list[int] = []
    total = 0
    for p in params.values():
        offsets.append(total)
        total += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    raw = huge_page_buffer(total)
    with torch.no_grad():
        for off, p in zip(offsets, params.values(), strict=True):
            nbytes = p.numel() * p.element_size()
            new = raw[off : off + nbytes].view(p.dtype).view(p.shape)
            new.copy_(p.data)
            p.data = new
    return total


def _move_quantized(module: nn.Module) -> int:
    """Copy the blocks of every quantized weight of ``module`` onto huge pages (shared
    weights once) and point their owners at the copies; return the bytes moved."""
    owners: dict[int, list[nn.Module]] = {}
    weights: dict[int, QuantizedWeight] = {}
    for sub in module.modules():
        w = getattr(sub, "weight", None)
        if isinstance(w, QuantizedWeight) and w.blocks.device.type == "cpu":
            owners.setdefault(id(w), []).append(sub)
            weights[id(w)] = w
    if not weights:
        return 0
    offsets: list[int] = []
    total = 0
    for w in weights.values():
        offsets.append(total)
        total += -(-w.nbytes // _ALIGN) * _ALIGN
    raw = huge_page_buffer(total)
    for off, (key, w) in zip(offsets, weights.items(), strict=True):
        blocks = raw[off : off + w.nbytes].view(w.blocks.shape)
        blocks.copy_(w.blocks)
        moved = QuantizedWeight(w.ggml_type, w.shape, blocks)
        for sub in owners[key]:
            sub.weight = moved
    return total
