"""Will a model (and a draft/target pair) load, and what will it cost: without its weights.

:func:`inspect_model` reads what the loader reads first, and only that: the config
(``config.json``, or a GGUF file's metadata, through the loader's own
:func:`~specserve.engine.loader.read_config`, so a family or feature the engine does not
support is refused with the loader's sentence), the tensor headers (safetensors' JSON
header, GGUF's tensor table), and builds the decoder on the ``meta`` device (no memory)
to count its parameters. It never reads a weight's values, so a file whose tensors do
not match its config is only found out at load.

Memory, on a CPU: the **resident weights** in the load dtype (a mixture of experts':
every expert, though a token multiplies only a few,
:attr:`ModelFacts.active_parameters`), a GGUF file's matrices of the block types the
kernels read kept as blocks in the quantized form
(:func:`~specserve.engine.gguf_weights.keeps_blocks`), Q4_K, Q6_K and Q5_0 matrices
counted twice (the kernels' repacked copy, made at a matrix's first product; a spec
without ``:weights=`` is taken in the form a CPU with the engine's kernels loads,
quantized, and the kernels are not built for a check), and the **KV cache**: float32 K
and V per token over every layer and KV head (the CPU's activation dtype; every
session's token costs it, up to the server's ``--kv-budget``).

:func:`pair_problem` applies the pair rule (:mod:`specserve.engine.tokenizer_identity`):
from the GGUF metadata where both models are GGUF files, else from the tokenizers
transformers loads.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.engine.config import ModelConfig
from specserve.engine.errors import ModelLoadError
from specserve.engine.gguf_reader import GGUFCheckpoint
from specserve.engine.gguf_weights import keeps_blocks
from specserve.engine.model import CausalLM
from specserve.engine.model_spec import DEFAULT_WEIGHT_FORM, ModelSpec, WeightForm
from specserve.engine.quant import GGMLType
from specserve.engine.tokenizer_identity import (
    TokenizerIdentity,
    identity_of_gguf,
    identity_of_tokenizer,
    pair_difference,
)

KV_DTYPE = torch.float32  # what a CPU's KV cache holds (models compute in float32 there)
_REPACKED_TYPES = frozenset({GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q5_0})


@dataclass(frozen=True)
class ModelFacts:
    """What :func:`inspect_model` found: the model's config, where it is, its weights'
    format (``"GGUF"``, ``"safetensors"`` or ``"tiny random"``) and tensor types (type
    name -> tensors), its parameters and what it will hold in memory."""

    spec: ModelSpec
    path: Path | None  # None for a tiny random model
    config: ModelConfig
    weight_format: str
    tensor_types: dict[str, int]
    file_bytes: int  # the checkpoint's tensor bytes (0 for a tiny model)
    parameters: int
    resident_bytes: int  # the weights once loaded
    weight_form: WeightForm | None  # a GGUF file's form; None otherwise

    @property
    def active_parameters(self) -> int:
        """Parameters a token's forward multiplies: all of them, but for a mixture of
        experts only its ``num_experts_per_tok`` experts of each layer (every expert is
        resident all the same, and counted in :attr:`parameters` and the memory)."""
        cfg = self.config
        idle = cfg.num_experts - cfg.num_experts_per_tok
        per_expert = 3 * cfg.hidden_size * cfg.expert_intermediate_size
        return self.parameters - cfg.num_layers * idle * per_expert

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one cached token takes over all layers and KV heads."""
        cfg = self.config
        elem = torch.empty((), dtype=KV_DTYPE).element_size()
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem


def inspect_model(
    spec: ModelSpec, path: Path | None, dtype: torch.dtype = torch.float32
) -> ModelFacts:
    """The facts of ``spec`` (its checkpoint at ``path``, located by the caller; None for
    a tiny spec) loaded in ``dtype`` on a CPU; :class:`~specserve.engine.errors.EngineError`
    with the loader's sentence where it will not load."""
    from specserve.engine.loader import read_config
    from specserve.engine.tiny import tiny_spec_config

    elem = torch.empty((), dtype=dtype).element_size()
    if spec.tiny is not None:
        cfg = tiny_spec_config(spec.tiny)
        params = _parameters(cfg)
        types = {str(dtype).removeprefix("torch."): 1}
        return ModelFacts(spec, None, cfg, "tiny random", types, 0, params, params * elem, None)
    assert path is not None, "a checkpoint spec needs its located path"
    cfg = read_config(path)  # the loader's refusals: unsupported family or feature
    params = _parameters(cfg)
    if path.is_dir():
        types, file_bytes = _safetensors_headers(path)
        return ModelFacts(
            spec, path, cfg, "safetensors", types, file_bytes, params, params * elem, None
        )
    # Without a form named: a CPU's default with the kernels, never built for a check.
    form = spec.weights or DEFAULT_WEIGHT_FORM
    counts: Counter[str] = Counter()
    file_bytes = resident = 0
    with GGUFCheckpoint(path) as checkpoint:
        import gguf

        for t in checkpoint.tensors(data=False):
            rows = 1
            for n in t.shape[:-1]:
                rows *= n
            nbytes = rows * t.data.shape[1]
            counts[gguf.GGMLQuantizationType(t.ggml_type).name] += 1
            file_bytes += nbytes
            numel = rows * t.shape[-1]
            if form == WeightForm.QUANTIZED and keeps_blocks(t):
                resident += nbytes * (2 if _repacked(t.name, t.ggml_type, cfg) else 1)
            else:
                resident += numel * elem
    return ModelFacts(spec, path, cfg, "GGUF", dict(counts), file_bytes, params, resident, form)


def _repacked(name: str, ggml_type: int, cfg: ModelConfig) -> bool:
    """Whether the kernels hold a repacked copy of a kept matrix beside its blocks (the
    same bytes again, made at its first product): Q4_K, Q6_K and Q5_0 matrices that
    multiply, so not an untied embedding, which only gathers rows."""
    if ggml_type not in _REPACKED_TYPES:
        return False
    return name != "model.embed_tokens.weight" or cfg.tie_word_embeddings


def _parameters(cfg: ModelConfig) -> int:
    """Parameters of the decoder ``cfg`` builds (a tied LM head counted once), built on
    the meta device: shapes only."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    return sum(p.numel() for p in model.parameters())


def _safetensors_headers(directory: Path) -> tuple[dict[str, int], int]:
    """Tensor dtypes (name -> tensors) and tensor bytes of a directory's safetensors
    files, from their JSON headers."""
    from specserve.engine.loader import weight_files

    counts: Counter[str] = Counter()
    total = 0
    for file in weight_files(directory):
        try:
            with file.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error) as exc:
            raise ModelLoadError(f"{file} is not a valid safetensors file ({exc})") from exc
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            counts[entry["dtype"]] += 1
            start, end = entry["data_offsets"]
            total += end - start
    return dict(counts), total


def tokenizer_identity(facts: ModelFacts) -> TokenizerIdentity | None:
    """The identity of a model's tokenizer (None for a tiny model): from a GGUF file's
    metadata, else from the tokenizer transformers loads."""
    from specserve.engine.loader import load_tokenizer

    if facts.path is None:
        return None
    if facts.path.is_file():
        with GGUFCheckpoint(facts.path) as checkpoint:
            return identity_of_gguf(checkpoint)
    return identity_of_tokenizer(load_tokenizer(facts.path))


def pair_problem(draft: ModelFacts, target: ModelFacts) -> str | None:
    """Why ``draft`` cannot draft for ``target`` (one sentence), or None where it can:
    their tokenizers must be the same (:mod:`specserve.engine.tokenizer_identity`).
    Compared from GGUF metadata where both are GGUF files, else from the tokenizers
    transformers loads for both; a tiny model has no tokenizer and passes."""
    from specserve.engine.loader import load_tokenizer

    if draft.path is None or target.path is None:
        return None
    if draft.path.is_file() and target.path.is_file():
        pair = (tokenizer_identity(draft), tokenizer_identity(target))
        if None not in pair:
            return pair_difference(*pair)  # type: ignore[arg-type]
    identities = [identity_of_tokenizer(load_tokenizer(f.path)) for f in (draft, target)]  # type: ignore[arg-type]
    return pair_difference(*identities)
