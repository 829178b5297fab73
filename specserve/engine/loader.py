"""Checkpoint -> engine weights and tokenizer, and a parsed model spec -> a ready model.

The engine reads a local Hugging Face directory (``config.json`` + ``*.safetensors``, a
sharded ``model.safetensors.index.json`` included) or a GGUF file, directly and
memory-mapped (:mod:`specserve.engine.gguf_reader`), whose block-quantized matrices stay
quantized or are dequantized at load (:mod:`specserve.engine.gguf_weights`). Finding the
directory or file for a store name or a hub id is the model store's job
(:mod:`specserve.model_store`, a layer above the engine): :func:`load_spec` takes it as
the ``locate`` function, so the engine imports nothing above itself.

Weights go straight from the file into a :class:`CausalLM` built on the ``meta``
device, one tensor at a time, so a model is never held twice in memory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from specserve.engine import cpu_kernels
from specserve.engine.config import ModelConfig
from specserve.engine.dtypes import DTYPES, parse_dtype
from specserve.engine.errors import InvalidArgument, ModelLoadError, NotFound
from specserve.engine.families import checkpoint_name, family, projection_rows, split_fused
from specserve.engine.gguf_reader import GGUFCheckpoint, is_gguf
from specserve.engine.gguf_weights import default_weight_form, fill_from_gguf
from specserve.engine.hugepages import move_to_huge_pages
from specserve.engine.model import CausalLM
from specserve.engine.model_spec import ModelSpec, WeightForm
from specserve.engine.quantized_layers import is_quantized
from specserve.engine.tiny import tiny_from_spec
from specserve.engine.tokenizer import Tokenizer, check_compatible

__all__ = [
    "LoadedModel",
    "Locate",
    "Tokenizer",
    "check_compatible",
    "load_model",
    "load_spec",
    "load_spec_tokenizer",
    "load_tokenizer",
    "prepare",
    "read_config",
]

# A checkpoint source (directory, GGUF file, store name, hub id) -> its local directory
# or GGUF file.
Locate = Callable[[str], Path]
# Checkpoint entries that are not weights of ours; skipped when present.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def _model_path(path: str | Path) -> Path:
    """``path`` if it is a model directory or a GGUF file."""
    found = Path(path).expanduser()
    if found.is_dir():
        return found
    if found.is_file():
        if found.suffix == ".gguf" or is_gguf(found):
            return found
        raise ModelLoadError(
            f"{path} is a file but not a GGUF file; pass a model directory or a .gguf file"
        )
    raise NotFound(f"{str(path)!r} is not a model directory or a GGUF file")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def read_config(directory: Path) -> ModelConfig:
    """:class:`ModelConfig` of a model directory, with generation-config EOS ids merged in,
    or of a GGUF file (from its metadata)."""
    directory = _model_path(directory)
    if directory.is_file():
        with GGUFCheckpoint(directory) as checkpoint:
            return checkpoint.config()
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory} has no config.json, so it is not a model directory")
    hf = _read_json(path)
    try:
        cfg = ModelConfig.from_hf(hf)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path} lacks or has a bad value for {exc}") from exc
    gen_path = directory / "generation_config.json"
    if gen_path.is_file():
        eos = _read_json(gen_path).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *(int(e) for e in extra)]))
        cfg = replace(cfg, eos_token_ids=merged)
    return cfg


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory (one, a sharded index's, or all)."""
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"shard {f.name} named in {index.name} is missing")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{directory} has no *.safetensors weights (pytorch_model.bin is not supported)"
        )
    return files


def _fill(model: CausalLM, files: list[Path], dtype: torch.dtype, device: torch.device) -> None:
    """Replace the meta parameters of ``model`` by the checkpoint's tensors, one at a time;
    a fused matrix of the family (Phi-3's ``qkv_proj``) is split into its parts' rows, and
    names the decoder spells otherwise (Mixtral's experts) are renamed."""
    cfg = model.config
    fam = family(cfg.model_type)
    rows = projection_rows(cfg)
    expected = dict(model.named_parameters())  # a tied lm_head is listed once, as embed_tokens
    seen: set[str] = set()
    unexpected: list[str] = []

    def put(key: str, tensor: torch.Tensor, file: Path) -> None:
        if fam.norm_offset and key.endswith("norm.weight"):  # Gemma's 1 + weight, once
            tensor = tensor.float() + fam.norm_offset
        want = expected[key].shape
        if tensor.shape != want:
            raise ModelLoadError(
                f"weight {key} in {file.name} has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(want)}"
            )
        if not tensor.is_floating_point():
            raise ModelLoadError(
                f"weight {key} in {file.name} is {tensor.dtype}; only float "
                "checkpoints are supported (quantized ones go through GGUF)"
            )
        owner, _, attr = key.rpartition(".")
        param = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
        setattr(model.get_submodule(owner), attr, param)
        seen.add(key)

    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for stored in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    key = checkpoint_name(fam, stored) if fam.renamed else stored
                    parts = split_fused(fam, key, rows) if fam.fused else None
                    if parts is not None:
                        fused = f.get_tensor(stored)
                        for name, start, end in parts:
                            # A copy: a part must not keep the whole fused matrix alive.
                            put(name, fused[start:end].clone(), file)
                        continue
                    if key not in expected:
                        tied_head = key == "lm_head.weight" and cfg.tie_word_embeddings
                        if not (tied_head or _IGNORED.match(key)):
                            unexpected.append(stored)
                        continue
                    put(key, f.get_tensor(stored), file)
        except SafetensorError as exc:
            raise ModelLoadError(f"{file} is not a valid safetensors file ({exc})") from exc
    if unexpected:
        raise ModelLoadError(
            f"the checkpoint has {len(unexpected)} weights a {cfg.model_type} decoder does not "
            f"use, e.g. {unexpected[0]}"
        )
    missing = sorted(set(expected) - seen)
    if missing:
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} weights, e.g. {missing[0]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def load_model(
    source: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    huge_pages: bool = True,
    weights: WeightForm | str | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """Load the model directory or GGUF file ``source`` as a :class:`CausalLM` in ``dtype``
    on ``device``.

    A GGUF file's block-quantized matrices stay blocks (``weights="quantized"``) or are
    dequantized to ``dtype`` at load (``"dequantized"``); its other tensors are read in
    ``dtype`` (:mod:`specserve.engine.gguf_weights`); ``None`` picks the device's default
    (:func:`~specserve.engine.gguf_weights.default_weight_form`: quantized on a CPU with
    the kernels). ``weights`` does not matter for a safetensors directory.

    On CPU the weights then move onto transparent huge pages where the kernel offers
    them (:mod:`specserve.engine.hugepages`): resident, 64-byte aligned memory that a
    decode step streams 5-20% faster than the checkpoint's 4 KiB pages.

    bfloat16 on a CPU with the engine's kernels means bfloat16 weight matrices under
    float32 activations, norms and KV cache (:meth:`CausalLM.compute_in_float32`):
    half the bytes per step of float32 weights, and the kernels' exactness across row
    counts. Elsewhere (GPU, no kernels) bfloat16 is bfloat16 throughout.
    """
    if dtype not in DTYPES.values():
        raise InvalidArgument(f"dtype {dtype} is not supported; choose from {', '.join(DTYPES)}")
    form = None if weights is None else WeightForm.parse(str(weights))
    path = _model_path(source)
    if path.is_file():
        form = form or default_weight_form(torch.device(device))
        with GGUFCheckpoint(path) as checkpoint:
            cfg = checkpoint.config()
            model = _meta_model(cfg)
            fill_from_gguf(model, checkpoint, dtype, torch.device(device), form)
    else:
        cfg = read_config(path)
        files = weight_files(path)
        model = _meta_model(cfg)
        _fill(model, files, dtype, torch.device(device))
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()]), "unfilled tensor"
    return prepare(model, huge_pages=huge_pages), cfg


def random_model(
    cfg: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    *,
    seed: int = 0,
    std: float = 0.02,
) -> CausalLM:
    """A model of ``cfg``'s shape with random weights made where they will compute: the
    loader's path (a meta model whose parameters are replaced on ``device`` one at a
    time, then :func:`prepare`) with a generator instead of a checkpoint. For measuring
    real shapes on a device without their weights (``bench.device_shapes``): the norms
    are ones, every other tensor is normal with ``std``; the tokens mean nothing."""
    device = torch.device(device)
    model = _meta_model(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in list(model.named_parameters()):  # a tied head is listed once
        owner, _, attr = name.rpartition(".")
        tensor = torch.empty(param.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, std, generator=gen)
        setattr(model.get_submodule(owner), attr, nn.Parameter(tensor, requires_grad=False))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return prepare(model, huge_pages=False)


def _meta_model(cfg: ModelConfig) -> CausalLM:
    """A model of ``cfg`` whose weights are still to be filled in."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    # The rotary tables are plain tensors, not parameters: rebuild them off the meta device.
    model.build_rotary()
    return model


def prepare(model: CausalLM, *, huge_pages: bool = True) -> CausalLM:
    """Ready a model whose weights are in place (loaded, or ``.to()`` a dtype) to serve.

    On CPU: bfloat16 weights compute in float32 where the kernels exist (see
    :func:`load_model`), and the weights move onto huge pages if ``huge_pages``. A model
    with block-quantized weights always computes in float32, on any device: its
    products are those of the float32 model on the dequantized weights.
    """
    quantized = is_quantized(model)
    if model.device.type == "cpu":
        if quantized or (model.dtype == torch.bfloat16 and cpu_kernels.kernels() is not None):
            model.compute_in_float32()
        if huge_pages:
            move_to_huge_pages(model)
    elif quantized:
        model.compute_in_float32()
    return model.eval()


def load_tokenizer(source: str | Path) -> Tokenizer:
    """The tokenizer of the model directory or GGUF file ``source`` (for GGUF, built by
    transformers from the file's metadata).

    transformers' ``AutoTokenizer`` reads a GGUF file's model config first and refuses
    an architecture its GGUF loader does not know (``granite``, ``olmo2``), though the
    tokenizer's metadata does not depend on it: there the fast tokenizer is built from
    the metadata alone (the same token ids; the class is transformers' generic one)."""
    path = _model_path(source)
    cfg = read_config(path)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # heavy; only here

    try:
        if path.is_file():
            try:
                hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            except ValueError:  # an architecture transformers' GGUF config loader refuses
                hf = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            hf = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ModelLoadError(f"could not load the tokenizer in {path} ({exc})") from exc
    return Tokenizer(hf, cfg.eos_token_ids)


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve and its tokenizer (None for tiny random models)."""

    model: CausalLM
    tokenizer: Tokenizer | None

    @property
    def vocab(self) -> int:
        """Ids the tokenizer can produce: embedding matrices are often padded past it."""
        vocab = self.model.config.vocab_size
        return vocab if self.tokenizer is None else min(vocab, self.tokenizer.vocab_size)


def load_spec(
    spec: ModelSpec | str,
    dtype: str | torch.dtype,
    *,
    locate: Locate,
    device: str | torch.device = "cpu",
    huge_pages: bool = True,
    tokenizer: bool = True,
) -> LoadedModel:
    """The model ``spec`` names, in ``dtype``, prepared (:func:`prepare`) to serve.

    A tiny spec is built here (never on huge pages: it is a few hundred KiB); any other is
    read from ``locate(spec.source)``, a GGUF file in the spec's weight form
    (:attr:`ModelSpec.weights`). ``tokenizer`` False skips loading the tokenizer.
    """
    spec = ModelSpec.parse(spec) if isinstance(spec, str) else spec
    torch_dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    if spec.tiny is not None:
        model = tiny_from_spec(spec.tiny).to(device=device, dtype=torch_dtype)
        return LoadedModel(prepare(model, huge_pages=False), None)
    path = locate(spec.source)
    model, _ = load_model(path, torch_dtype, device, huge_pages=huge_pages, weights=spec.weights)
    return LoadedModel(model, load_tokenizer(path) if tokenizer else None)


def load_spec_tokenizer(spec: ModelSpec | str, *, locate: Locate) -> Tokenizer | None:
    """The tokenizer of ``spec`` without its weights; None for a tiny random model."""
    spec = ModelSpec.parse(spec) if isinstance(spec, str) else spec
    return None if spec.tiny is not None else load_tokenizer(locate(spec.source))
