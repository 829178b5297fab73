"""The weight dtypes the engine serves, by name: the one list every flag and record uses.

Names are what command-line flags, configs and KV-chunk records carry; :data:`DTYPES`
maps them to torch dtypes. :func:`parse_dtype` also takes the short aliases
(``fp32``, ``bf16``, ``fp16``, ``half``).
"""

from __future__ import annotations

import torch

from specserve.engine.errors import InvalidArgument

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPES)  # argparse ``choices``, in this order
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def parse_dtype(name: str) -> torch.dtype:
    """A dtype name or alias (any case) -> its torch dtype; :class:`InvalidArgument` otherwise."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in DTYPES:
        raise InvalidArgument(f"dtype {name!r} is not supported; choose from {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a supported torch dtype; :class:`InvalidArgument` for any other."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise InvalidArgument(f"dtype {dtype} is not supported; choose from {', '.join(DTYPES)}")
