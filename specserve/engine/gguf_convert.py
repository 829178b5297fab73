"""GGUF file -> Hugging Face safetensors directory, done once per file.

transformers reads GGUF (``gguf_file=``) but slowly: it dequantizes every tensor
on load (about 70 s for a 1.5B model on two cores). We pay that once, in a
child process so that its float32 copy of the model is gone before the engine
loads the result, and write a plain directory (``config.json``, safetensors,
tokenizer) that later loads take seconds to read.

Run directly as ``python -m specserve.engine.gguf_convert IN.gguf OUT_DIR``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from specserve.engine.errors import ModelLoadError, NotFound

GGUF_MAGIC = b"GGUF"
# GGUF `general.architecture` values whose tensors map onto our decoder.
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")
# Written last into a converted directory: its presence means the directory is complete.
MARKER = "specserve-conversion.json"
_SHARD_SIZE = "2GB"


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


def check_gguf(path: Path) -> str:
    """Validate a GGUF file cheaply (header, tensor table, sizes); return its architecture.

    Raises :class:`NotFound` for a missing file and :class:`ModelLoadError` for a
    file that is not GGUF, is truncated or corrupt, or holds an unsupported model.
    """
    if not path.is_file():
        raise NotFound(f"GGUF file {path} does not exist")
    if not is_gguf(path):
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    import gguf  # a heavy import, only needed here

    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        arch = str(field.contents())
        size = path.stat().st_size
        for t in reader.tensors:
            if int(t.data_offset) + int(t.n_bytes) > size:
                raise ValueError(f"tensor {t.name} ends past the end of the file")
    except KeyError:
        raise ModelLoadError(f"GGUF file {path} has no general.architecture entry") from None
    except Exception as exc:  # the reader raises many kinds on bad bytes
        raise ModelLoadError(f"GGUF file {path} is truncated or corrupt ({exc})") from exc
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise ModelLoadError(
            f"GGUF file {path} holds a {arch!r} model; supported architectures: {supported}"
        )
    return arch


def is_converted(directory: Path, sha256: str | None = None) -> bool:
    """Whether ``directory`` holds a finished conversion (of the file with ``sha256``)."""
    marker = directory / MARKER
    if not marker.is_file():
        return False
    if sha256 is None:
        return True
    try:
        return json.loads(marker.read_text()).get("sha256") == sha256
    except (OSError, ValueError):
        return False


def convert_gguf(gguf_path: Path, out_dir: Path, sha256: str | None = None) -> float:
    """Convert ``gguf_path`` into a safetensors directory at ``out_dir``; return seconds taken.

    The work happens in a child process; ``out_dir`` appears atomically (a
    temporary sibling is renamed into place), so an interrupted conversion
    leaves nothing that looks finished.
    """
    check_gguf(gguf_path)
    sha256 = sha256 or sha256_file(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.monotonic()
    cmd = [sys.executable, "-m", "specserve.engine.gguf_convert", str(gguf_path), str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        if proc.returncode < 0:
            last = f"the converter was killed by signal {-proc.returncode} (out of memory?)"
        raise ModelLoadError(f"converting GGUF file {gguf_path} failed: {last}")
    info = {"source": gguf_path.name, "sha256": sha256, "seconds": round(seconds, 1)}
    (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return seconds


def _convert_in_process(gguf_path: Path, out_dir: Path) -> None:
    """The child process's work: dequantize with transformers and save as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers dequantizes llama/qwen2 GGUF fully on load, yet keeps the GGUF
    # quantizer attached, which refuses to save; the tensors are plain float32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, max_shard_size=_SHARD_SIZE)
    del model
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out_dir)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the conversion child process."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m specserve.engine.gguf_convert IN.gguf OUT_DIR", file=sys.stderr)
        return 2
    try:
        _convert_in_process(Path(args[0]), Path(args[1]))
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}".replace("\n", " "), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
