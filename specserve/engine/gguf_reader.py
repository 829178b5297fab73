"""A GGUF file, memory-mapped: its model config and its tensors under Hugging Face names.

:class:`GGUFCheckpoint` parses the header, the metadata and the tensor table of a
GGUF file (format version 2 or 3, little-endian) and maps the file read-only; the
tensor bytes are never read into Python objects. Metadata arrays (the tokenizer's
151k tokens and merges) are skipped, not decoded: opening the Qwen2.5 target's
1 GiB file takes a fraction of a second.

Tensors are named as the Hugging Face checkpoints name them (``blk.3.attn_q.weight``
-> ``model.layers.3.self_attn.q_proj.weight``) and arranged as transformers arranges
them when it reads a GGUF file, so that a model loaded from here equals the one the
earlier GGUF -> safetensors conversion produced: for the families whose converter
interleaves the q/k rows for llama.cpp's RoPE kernel (``llama``, ``granite``:
:attr:`Family.gguf_permuted_qk <specserve.engine.families.Family.gguf_permuted_qk>`),
those rows are put back in Hugging Face order (a row permutation, which a
block-quantized matrix undergoes on its rows of blocks unchanged); a fused matrix
(``phi3``'s ``attn_qkv`` and its gate-and-up ``ffn_up``) comes out as its parts' rows
(:func:`~specserve.engine.families.split_fused`), blocks included; llama.cpp's stacked
experts (``ffn_gate_exps`` ``[experts, out, in]``) come out one matrix per expert, a
slice of whole rows (blocks kept), and a ``llama`` file with ``expert_count`` is a
Mixtral. The family's
metadata (Granite's ``embedding_scale``, ``residual_scale``, ``logit_scale`` and
``attention.scale``, Gemma's ``final_logit_softcapping`` and ``attn_logit_softcapping``,
a ``sliding_window``) goes into the config under the Hugging Face
names.

Every problem with the file (not GGUF, truncated, a tensor past the end, an
unsupported architecture, metadata the decoder needs missing) is a
:class:`ModelLoadError` naming the file; a missing file is :class:`NotFound`.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specserve.engine.config import ModelConfig
from specserve.engine.errors import ModelLoadError, NotFound
from specserve.engine.families import (
    GGUF_EXPERT_MODEL_TYPES,
    GGUF_MODEL_TYPES,
    family,
    projection_rows,
    split_fused,
)
from specserve.engine.gguf_names import expert_template, hf_name, unpermute_rows

GGUF_MAGIC = b"GGUF"
# GGUF `general.architecture` values whose tensors map onto our decoder.
GGUF_ARCHITECTURES: tuple[str, ...] = tuple(GGUF_MODEL_TYPES)
_DEFAULT_ALIGNMENT = 32
# Metadata arrays kept whole (every other long array stands as its length): the
# tokenizer's identity (:mod:`specserve.engine.tokenizer_identity`), ~10 MB for 152k tokens.
_WHOLE_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.token_type"})

# GGUF metadata value types: id -> struct format of a scalar (8: string, 9: array).
_SCALARS = dict(enumerate("BbHhIif?")) | {10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# llama.cpp metadata (after "<arch>.") -> the Hugging Face config field it sets.
_SCALARS_TO_HF = {
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "logit_scale": "logits_scaling",
    "attention.scale": "attention_multiplier",
    "final_logit_softcapping": "final_logit_softcapping",
    "attn_logit_softcapping": "attn_logit_softcapping",
}


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic bytes."""
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file, under its Hugging Face name, still in the file's encoding.

    ``shape`` is the torch shape (``[out_features, in_features]`` for a matrix: GGUF
    lists dimensions innermost first, so this is its ``ne`` reversed). ``data`` is a
    read-only view of the mapped file, ``[rows, bytes_per_row]`` uint8 with
    ``rows = prod(shape[:-1])``, q/k rows already in Hugging Face order.
    """

    name: str
    gguf_name: str
    ggml_type: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]
    data: np.ndarray  # [rows, bytes_per_row] uint8


class _Cursor:
    """Reads little-endian GGUF values from a buffer, raising ValueError past its end."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise ValueError("the header ends past the end of the file")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string ends past the end of the file")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        """One metadata value; an array is skipped and stands as its length (an int in a
        tuple), except short arrays of scalars, which are returned as tuples."""
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self.take("I"), self.take("Q")
        if item in _SCALARS:
            size = struct.calcsize("<" + _SCALARS[item])
            if count <= 64:
                return tuple(self.take(_SCALARS[item]) for _ in range(count))
            self.pos += size * count
            if self.pos > len(self.buf):
                raise ValueError("an array ends past the end of the file")
            return (count,)
        for _ in range(count):  # strings (or nested arrays): walk over them
            self.value(item)
        return (count,)

    def whole_array(self) -> tuple[Any, ...]:
        """An array value read whole, however long (strings or scalars)."""
        item, count = self.take("I"), self.take("Q")
        return tuple(self.value(item) for _ in range(count))


class GGUFCheckpoint:
    """An open, validated GGUF file (see the module doc). Close it, or use ``with``."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise NotFound(f"GGUF file {path} does not exist")
        if not is_gguf(path):
            raise ModelLoadError(
                f"{path} is not a GGUF file (it does not start with the GGUF magic)"
            )
        self.path = path
        with path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse()
        except ValueError as exc:
            self.close()
            raise ModelLoadError(f"GGUF file {path} is truncated or corrupt ({exc})") from exc
        except ModelLoadError:
            self.close()
            raise

    def _parse(self) -> None:
        import gguf  # constants and block sizes of every GGML type

        cur = _Cursor(self._map)
        cur.pos = 4
        version = cur.take("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
        n_tensors, n_kv = cur.take("Q"), cur.take("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            kind = cur.take("I")
            whole = kind == _ARRAY and key in _WHOLE_ARRAYS
            self.metadata[key] = cur.whole_array() if whole else cur.value(kind)
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"GGUF file {self.path} has no general.architecture entry")
        if arch not in GGUF_ARCHITECTURES:
            supported = ", ".join(GGUF_ARCHITECTURES)
            raise ModelLoadError(
                f"GGUF file {self.path} holds a {arch!r} model; supported architectures: "
                f"{supported}"
            )
        self.architecture = arch
        self.model_type = GGUF_MODEL_TYPES[arch]
        if self.metadata.get(f"{arch}.expert_count") and arch in GGUF_EXPERT_MODEL_TYPES:
            self.model_type = GGUF_EXPERT_MODEL_TYPES[arch]  # llama.cpp's Mixtral
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.take("Q") for _ in range(cur.take("I")))
            infos.append((name, dims, cur.take("I"), cur.take("Q")))
        align = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-cur.pos // align) * align
        self._tensors: dict[str, tuple[str, int, tuple[int, ...], int, int]] = {}
        for name, dims, kind, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(kind)
            except ValueError:
                raise ValueError(f"tensor {name} has unknown GGML type {kind}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            if not dims or dims[0] % block:
                raise ValueError(f"tensor {name} has {dims} elements, not whole {block}-blocks")
            row_bytes = dims[0] // block * type_size
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            begin = start + offset
            if begin + rows * row_bytes > len(self._map):
                raise ValueError(f"tensor {name} ends past the end of the file")
            self._tensors[name] = (name, int(qtype), tuple(reversed(dims)), begin, row_bytes)

    def close(self) -> None:
        """Unmap the file (tensors handed out before must have been copied)."""
        # A caller still holding a view (BufferError) keeps the map alive until it lets go.
        with contextlib.suppress(BufferError):
            self._map.close()

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _field(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(f"{self.architecture}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF file {self.path} has no {self.architecture}.{key} entry")
        return value

    def config(self) -> ModelConfig:
        """The decoder's config, as transformers derives it from the same metadata."""
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        vocab = self.metadata.get(f"{self.architecture}.vocab_size")
        if vocab is None and isinstance(tokens, tuple) and tokens:
            vocab = len(tokens)  # kept whole (_WHOLE_ARRAYS)
        if vocab is None:
            raise ModelLoadError(f"GGUF file {self.path} states no vocabulary size")
        hf: dict[str, Any] = {
            "model_type": self.model_type,
            "vocab_size": int(vocab),
            "hidden_size": int(self._field("embedding_length")),
            "intermediate_size": int(
                self.metadata.get(f"{self.architecture}.feed_forward_length")
                or self._field("expert_feed_forward_length")
            ),
            "num_hidden_layers": int(self._field("block_count")),
            "num_attention_heads": int(self._field("attention.head_count")),
            "num_key_value_heads": self._field("attention.head_count_kv", 0) or None,
            "rms_norm_eps": float(self._field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._field("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._field("context_length", 32768)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
        }
        key_length = self.metadata.get(f"{self.architecture}.attention.key_length")
        if key_length:
            hf["head_dim"] = int(key_length)
        for key, hf_key in _SCALARS_TO_HF.items():
            value = self.metadata.get(f"{self.architecture}.{key}")
            if value:
                hf[hf_key] = float(value)
        window = self.metadata.get(f"{self.architecture}.attention.sliding_window")
        if window:
            hf["sliding_window"], hf["use_sliding_window"] = int(window), True
        fam = family(self.model_type)
        experts = self.metadata.get(f"{self.architecture}.expert_count")
        if experts:
            hf["num_experts"] = int(experts)
            hf["num_experts_per_tok"] = int(self._field("expert_used_count"))
            size = self.metadata.get(f"{self.architecture}.expert_feed_forward_length")
            hf["moe_intermediate_size"] = int(size or hf["intermediate_size"])
            norm = self.metadata.get(f"{self.architecture}.expert_weights_norm")
            hf["norm_topk_prob"] = fam.gguf_norm_topk if norm is None else bool(norm)
            hf["n_shared_experts"] = self.metadata.get(f"{self.architecture}.expert_shared_count")
        pattern = self.metadata.get(f"{self.architecture}.attention.sliding_window_pattern")
        if window and (pattern or fam.gguf_sliding_pattern):
            # Per layer (true: sliding), or every n-th layer global: what llama.cpp reads,
            # or assumes for the family when the file states nothing.
            n = hf["num_hidden_layers"]
            if isinstance(pattern, tuple) and len(pattern) == n:
                slides = [bool(p) for p in pattern]
            else:
                every = pattern if isinstance(pattern, int) and pattern > 0 else None
                every = every or fam.gguf_sliding_pattern
                if not every:
                    raise ModelLoadError(
                        f"GGUF file {self.path} does not say which layers slide: "
                        f"{self.architecture}.attention.sliding_window_pattern is {pattern}"
                    )
                slides = [(i + 1) % every != 0 for i in range(n)]
            hf["layer_types"] = [
                "sliding_attention" if slide else "full_attention" for slide in slides
            ]
            base = self.metadata.get(f"{self.architecture}.rope.freq_base_swa")
            local = base or fam.gguf_local_rope_theta  # none (Gemma 2): the global base
            if local:
                hf["rope_local_base_freq"] = float(local)
        rope_dims = self.metadata.get(f"{self.architecture}.rope.dimension_count")
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        if rope_dims and int(rope_dims) != head_dim:
            hf["partial_rotary_factor"] = int(rope_dims) / head_dim
        if any(name.startswith("rope_factors") for name in self._tensors):
            raise ModelLoadError(
                f"GGUF file {self.path} has RoPE factor tensors (long-context RoPE "
                "scaling), which are not supported"
            )
        scaling = self.metadata.get(f"{self.architecture}.rope.scaling.type")
        if scaling not in (None, "none"):
            hf["rope_scaling"] = {
                "rope_type": scaling,
                "factor": float(self._field("rope.scaling.factor")),
                "original_max_position_embeddings": int(
                    self._field("rope.scaling.original_context_length")
                ),
            }
        try:
            return ModelConfig.from_hf(hf)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"GGUF file {self.path} has a bad value for {exc}") from exc

    def tensors(self, *, data: bool = True) -> Iterator[GGUFTensor]:
        """Every tensor under its Hugging Face name (see :class:`GGUFTensor`); a fused
        matrix comes out as its parts, one tensor each. ``data`` False: headers only,
        each ``data`` an empty ``[0, bytes_per_row]`` array (nothing of the file read)."""
        heads = self._field("attention.head_count")
        kv_heads = self._field("attention.head_count_kv", 0) or heads
        fam = family(self.model_type)
        rows_of = projection_rows(self.config()) if fam.fused else {}
        for gguf_name, qtype, shape, begin, row_bytes in self._tensors.values():
            rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
            name = hf_name(gguf_name, self.architecture)
            if data:
                values = np.frombuffer(self._map, np.uint8, rows * row_bytes, begin)
                values = values.reshape(rows, row_bytes)
                if fam.gguf_permuted_qk and name.endswith(
                    ("self_attn.q_proj.weight", "self_attn.k_proj.weight")
                ):
                    values = unpermute_rows(values, heads if "q_proj" in name else kv_heads)
            else:
                values = np.empty((0, row_bytes), np.uint8)
            experts = expert_template(gguf_name)
            if experts is not None:  # [experts, out, in]: one tensor per expert
                n, out = shape[0], shape[1]
                for e in range(n):
                    part = experts.format(e)
                    rows_e = values[e * out : (e + 1) * out]
                    yield GGUFTensor(part, gguf_name, qtype, shape[1:], rows_e)
                continue
            parts = split_fused(fam, name, rows_of) if fam.fused else None
            if parts is None:
                yield GGUFTensor(name, gguf_name, qtype, shape, values)
                continue
            for part, start, end in parts:
                part_shape = (min(end, rows) - min(start, rows), *shape[1:])
                yield GGUFTensor(part, gguf_name, qtype, part_shape, values[start:end])
