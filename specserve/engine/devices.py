"""The device a process computes on: parsed from a flag, checked against this machine.

A device is named ``cpu``, ``cuda`` (the first CUDA device the process sees, i.e. the
first one ``CUDA_VISIBLE_DEVICES`` leaves visible) or ``cuda:N``. :func:`parse_device`
turns the name into a :class:`torch.device` or raises :class:`InvalidArgument` with one
sentence a command line can print: an unknown name, CUDA asked for where
``torch.cuda.is_available()`` is false, or an index past the visible devices.

What runs where (the engine's contract):

* On ``cpu`` the few-row float32 products, norms, the decode/verify attention and the
  coupled argmax go to the C++ kernels (:mod:`specserve.engine.cpu_kernels`) where
  they build; everything else is torch.
* On ``cuda`` every op is a torch op on the model's device (the *device-generic
  path*); the kernels never run there. On a CPU the same path runs with the kernels
  turned off (:func:`specserve.engine.ops.kernels_enabled`), which is how the tests
  cover it without a GPU.

:func:`default_dtype` is the weight dtype a process uses when none is asked for:
bfloat16 on CUDA (tensor cores, half the memory), the process's CPU default on a CPU.
"""

from __future__ import annotations

import re

import torch

from specserve.engine.errors import InvalidArgument

DEVICE_NAMES = ("cpu", "cuda", "cuda:N")
CUDA_DEFAULT_DTYPE = "bfloat16"

_NAME = re.compile(r"(cpu)|cuda(?::(\d+))?")


def parse_device(name: str) -> torch.device:
    """The :class:`torch.device` called ``name``, which must exist on this machine."""
    m = _NAME.fullmatch(name.strip()) if isinstance(name, str) else None
    if m is None:
        raise InvalidArgument(
            f"unknown device {name!r}: use {', '.join(DEVICE_NAMES)} (N a CUDA device index)."
        )
    if m.group(1):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise InvalidArgument(
            f"device {name!r} needs CUDA, but torch.cuda.is_available() is false on this "
            f"machine (torch {torch.__version__}, CUDA build {torch.version.cuda}); use "
            "--device cpu."
        )
    index = int(m.group(2) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise InvalidArgument(
            f"device {name!r} does not exist: this process sees {count} CUDA device(s), "
            f"cuda:0 to cuda:{count - 1}."
        )
    return torch.device("cuda", index)


def check_device_name(name: str) -> str:
    """``name`` unchanged if it is a device name (see :data:`DEVICE_NAMES`), whether or
    not this machine has it; :class:`InvalidArgument` otherwise. For configs built on one
    machine for a process on another (a launcher, a manifest)."""
    if not isinstance(name, str) or _NAME.fullmatch(name.strip()) is None:
        raise InvalidArgument(
            f"unknown device {name!r}: use {', '.join(DEVICE_NAMES)} (N a CUDA device index)."
        )
    return name.strip()


def is_cuda(name: str) -> bool:
    """Whether the device name ``name`` (already checked) names a CUDA device."""
    return name.strip().startswith("cuda")


def default_dtype(device: str | torch.device, cpu_default: str) -> str:
    """The weight dtype for ``device`` when none is asked for: bfloat16 on CUDA,
    ``cpu_default`` on a CPU."""
    kind = device.type if isinstance(device, torch.device) else device.strip().split(":")[0]
    return CUDA_DEFAULT_DTYPE if kind == "cuda" else cpu_default
