"""Checkpoint -> engine weights and tokenizer.

A *source* is one of, in the order tried:

1. a local Hugging Face directory (``config.json`` + ``*.safetensors``, a
   sharded ``model.safetensors.index.json`` included);
2. a GGUF file, converted once to a safetensors directory under
   ``$SPECSERVE_HOME/converted/<stem>-<sha256 prefix>/`` and read from there;
3. the name of a model in the local store (``specserve models fetch``), e.g.
   ``qwen2.5-coder-1.5b-instruct``;
4. a Hugging Face hub id (``owner/name``), downloaded when the hub is reachable.

Weights go straight from safetensors into a :class:`CausalLM` built on the
``meta`` device, one tensor at a time, so a model is never held twice in memory.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from specserve import model_store
from specserve.engine import cpu_kernels
from specserve.engine.config import ModelConfig
from specserve.engine.errors import InvalidArgument, ModelLoadError, NotFound
from specserve.engine.gguf_convert import convert_gguf, is_converted, is_gguf, sha256_file
from specserve.engine.hugepages import move_to_huge_pages
from specserve.engine.model import CausalLM
from specserve.engine.rope import RotaryEmbedding
from specserve.engine.tokenizer import Tokenizer, check_compatible

__all__ = [
    "DTYPES",
    "Tokenizer",
    "check_compatible",
    "load_model",
    "load_tokenizer",
    "parse_dtype",
    "prepare",
    "read_config",
    "resolve_source",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Checkpoint entries that are not weights of ours; skipped when present.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model"]


def parse_dtype(name: str) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or fp32 / bf16 / fp16) -> torch dtype."""
    key = _DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPES:
        raise InvalidArgument(f"dtype {name!r} is not supported; choose from {', '.join(DTYPES)}")
    return DTYPES[key]


def resolve_source(source: str, home: Path | None = None) -> Path:
    """The local Hugging Face directory that ``source`` stands for (see the module doc)."""
    home = home or model_store.default_home()
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix == ".gguf" or is_gguf(path):
            return _converted_gguf(path, home)
        raise ModelLoadError(
            f"{source} is a file but not a GGUF file; pass a model directory or a .gguf file"
        )
    if source in model_store.MODELS:
        return model_store.resolve(source, home)
    looks_local = source.startswith(("/", ".", "~")) or source.endswith(".gguf")
    if not looks_local and _HUB_ID.fullmatch(source):
        return _hub_download(source)
    raise NotFound(
        f"{source!r} is not a directory, a GGUF file, a fetched model name "
        f"({', '.join(model_store.MODELS)}) or a hub id"
    )


def _converted_gguf(path: Path, home: Path) -> Path:
    sha = sha256_file(path)
    out = home / "converted" / f"{path.stem}-{sha[:12]}"
    if not is_converted(out, sha):
        convert_gguf(path, out, sha256=sha)
    return out


def _hub_download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=repo_id, allow_patterns=_HUB_FILES))
    except Exception as exc:  # offline, unknown repo, gated repo: all one answer
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({why}); "
            "pass a local directory, a GGUF file or a fetched model name instead"
        ) from exc


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def read_config(directory: Path) -> ModelConfig:
    """:class:`ModelConfig` of a model directory, with generation-config EOS ids merged in."""
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


def _weight_files(directory: Path) -> list[Path]:
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
    """Replace the meta parameters of ``model`` by the checkpoint's tensors, one at a time."""
    cfg = model.config
    expected = dict(model.named_parameters())  # a tied lm_head is listed once, as embed_tokens
    seen: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if key not in expected:
                        tied_head = key == "lm_head.weight" and cfg.tie_word_embeddings
                        if not (tied_head or _IGNORED.match(key)):
                            unexpected.append(key)
                        continue
                    tensor = f.get_tensor(key)
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
    home: Path | None = None,
    huge_pages: bool = True,
) -> tuple[CausalLM, ModelConfig]:
    """Load ``source`` (see the module doc) as a :class:`CausalLM` in ``dtype`` on ``device``.

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
    directory = resolve_source(str(source), home)
    cfg = read_config(directory)
    files = _weight_files(directory)
    with torch.device("meta"):
        model = CausalLM(cfg)
    # The rotary tables are plain tensors, not parameters: rebuild them off the meta device.
    model.rope = RotaryEmbedding(cfg)
    _fill(model, files, dtype, torch.device(device))
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()]), "unfilled tensor"
    return prepare(model, huge_pages=huge_pages), cfg


def prepare(model: CausalLM, *, huge_pages: bool = True) -> CausalLM:
    """Ready a model whose weights are in place (loaded, or ``.to()`` a dtype) to serve.

    On CPU: bfloat16 weights compute in float32 where the kernels exist (see
    :func:`load_model`), and the weights move onto huge pages if ``huge_pages``.
    """
    if model.device.type == "cpu":
        if model.dtype == torch.bfloat16 and cpu_kernels.kernels() is not None:
            model.compute_in_float32()
        if huge_pages:
            move_to_huge_pages(model)
    return model.eval()


def load_tokenizer(source: str | Path, *, home: Path | None = None) -> Tokenizer:
    """The tokenizer of ``source`` (for GGUF, that of its converted directory)."""
    directory = resolve_source(str(source), home)
    cfg = read_config(directory)
    from transformers import AutoTokenizer  # heavy; only needed here

    try:
        hf = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:
        raise ModelLoadError(f"could not load the tokenizer in {directory} ({exc})") from exc
    return Tokenizer(hf, cfg.eos_token_ids)


# --- tiny random models for tests ---------------------------------------------------
