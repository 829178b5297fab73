"""What a ``--model`` / ``--target`` / ``--draft`` flag names: the one parser of model specs.

A spec is either a tiny random test model,
``tiny:<seed>[:<model_type>][:noise=<x>][:vocab=<n>][:ctx=<n>]`` (see
:mod:`specserve.engine.tiny`), or a *source*: a model directory, a GGUF file, the name of
a model in the store or a hub id, optionally followed by ``:weights=quantized`` or
``:weights=dequantized`` (:class:`WeightForm`: how a GGUF file's block-quantized matrices
are held; without it, the default of the device the model loads on,
:func:`~specserve.engine.gguf_weights.default_weight_form`). The engine only parses a
source; turning it into a local directory or GGUF file (store look-up, hub download) is
the model store's job, a layer above the engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from specserve.engine.errors import InvalidArgument

TINY_PREFIX = "tiny:"
WEIGHTS_OPTION = ":weights="
TINY_VOCAB = 256


class WeightForm(enum.StrEnum):
    """How a GGUF file's block-quantized matrices are held: as blocks, or dequantized to
    the model's dtype at load (:mod:`specserve.engine.gguf_weights`)."""

    QUANTIZED = "quantized"
    DEQUANTIZED = "dequantized"

    @classmethod
    def parse(cls, name: str) -> WeightForm:
        """``"quantized" | "dequantized"`` -> the form; :class:`InvalidArgument` otherwise."""
        try:
            return cls(name)
        except ValueError:
            choices = ", ".join(f.value for f in cls)
            raise InvalidArgument(f"weights {name!r} is not one of {choices}") from None


# What a GGUF file loads as on a CPU with the engine's kernels when its spec names no
# form: the blocks as shipped, which the kernels read with the bits of the dequantized
# float32 model (default_weight_form in gguf_weights picks per device).
DEFAULT_WEIGHT_FORM = WeightForm.QUANTIZED
_TINY_FORM = "tiny:<seed>[:<model_type>][:noise=<x>][:vocab=<n>][:ctx=<n>]"


@dataclass(frozen=True)
class TinySpec:
    """A seeded random model: its seed, architecture, weight noise, vocabulary and context.

    ``noise`` perturbs every weight by that many standard deviations (a draft that agrees
    with the noise-free target often, not always); ``ctx`` None keeps the config default.
    """

    seed: int
    model_type: str = "qwen2"
    noise: float = 0.0
    vocab: int = TINY_VOCAB
    ctx: int | None = None

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise InvalidArgument(f"a tiny model's seed must be >= 0, got {self.seed}")
        if not self.noise >= 0.0:  # NaN fails too
            raise InvalidArgument(f"a tiny model's noise must be >= 0, got {self.noise}")
        if self.vocab < 2:
            raise InvalidArgument(f"a tiny model's vocab must be >= 2, got {self.vocab}")
        if self.ctx is not None and self.ctx < 1:
            raise InvalidArgument(f"a tiny model's ctx must be >= 1, got {self.ctx}")


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model spec: ``tiny`` is set for a random test model, else ``source`` is."""

    text: str  # as given, for messages and child-process flags
    tiny: TinySpec | None = None
    weights: WeightForm | None = None  # a GGUF source's form; None: the device's default

    @property
    def is_tiny(self) -> bool:
        return self.tiny is not None

    @property
    def source(self) -> str:
        """The directory, GGUF file, store name or hub id; only for a non-tiny spec."""
        assert self.tiny is None, f"{self.text!r} is a tiny model, not a checkpoint source"
        return self.text.partition(WEIGHTS_OPTION)[0]

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """Parse a spec; :class:`InvalidArgument` for an empty or malformed one."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidArgument(f"a model spec must be a non-empty string, got {text!r}")
        if not text.startswith(TINY_PREFIX):
            source, has_form, form = text.partition(WEIGHTS_OPTION)
            if not has_form:
                return cls(text)
            if not source:
                raise InvalidArgument(f"model spec {text!r} names a weight form but no model")
            return cls(text, weights=WeightForm.parse(form))
        return cls(text, _parse_tiny(text))


def _parse_tiny(text: str) -> TinySpec:
    seed_text, *options = text.removeprefix(TINY_PREFIX).split(":")
    fields: dict[str, object] = {}
    try:
        fields["seed"] = int(seed_text)
        for option in options:
            key, has_value, value = option.partition("=")
            if not has_value:
                if not option or "model_type" in fields:
                    raise ValueError(f"unexpected part {option!r}")
                fields["model_type"] = option
            elif key == "noise":
                fields["noise"] = float(value)
            elif key in ("vocab", "ctx"):
                fields[key] = int(value)
            else:
                raise ValueError(f"unknown option {key!r}")
    except ValueError as exc:
        raise InvalidArgument(
            f"bad tiny model spec {text!r}: {exc} (expected {_TINY_FORM})"
        ) from None
    return TinySpec(**fields)  # type: ignore[arg-type]
