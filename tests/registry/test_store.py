from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pipeline.errors import IllegalTransitionError, IntegrityError, NotFoundError, RegistryPathError
from pipeline.specs import SourceKind, SourceRef, VersionState
from registry import open_registry
from registry.store import RegisterRequest

SRC = SourceRef(kind=SourceKind.LOCAL, path="/x", content_hash="ab" * 32)


def _req(tmp: Path, name: str = "Q8_0", key: str = "k1", data: bytes = b"gguf-bytes" * 100,
         **kw: object) -> RegisterRequest:
    f = tmp / f"{name}-{key}.bin"
    f.write_bytes(data)
    return RegisterRequest(model="demo", source=SRC, variant=name, format="gguf", spec={"type": name},
                           build_key=key, lineage={"tool": "t"}, files={f"demo-{name}.gguf": f}, **kw)


def test_register_is_idempotent_per_build_key(tmp_path: Path, registry_path: Path) -> None:
    reg = open_registry(str(registry_path))
    v1 = reg.register_version(_req(tmp_path))
    again = reg.register_version(_req(tmp_path))
    forced = reg.register_version(_req(tmp_path, force=True))
    other = reg.register_version(_req(tmp_path, key="k2", data=b"other"))
    assert (v1.number, v1.created) == (1, True)
    assert (again.number, again.created) == (1, False)
    assert (forced.number, other.number) == (2, 3)
    assert v1.files[0].sha256 == forced.files[0].sha256  # identical bytes stored once
    assert len(list(reg.blobs.list_digests())) == 2


def test_blob_layout_and_no_temp_left(tmp_path: Path, registry_path: Path) -> None:
    reg = open_registry(str(registry_path))
    view = reg.register_version(_req(tmp_path))
    digest = view.files[0].sha256
    assert (registry_path / "blobs" / "sha256" / digest[:2] / digest).is_file()
    assert not list((registry_path / "blobs" / "tmp").iterdir())


def test_pull_refuses_a_corrupt_blob(tmp_path: Path, registry_path: Path) -> None:
    reg = open_registry(str(registry_path))
    view = reg.register_version(_req(tmp_path))
    blob = reg.blobs.path_of(view.files[0].sha256)
    blob.chmod(0o644)
    data = bytearray(blob.read_bytes())
    data[10] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="corrupt"):
        reg.pull("demo/Q8_0@1", tmp_path / "out")
    assert not (tmp_path / "out" / "demo-Q8_0.gguf").exists()
    assert not [p for p in (tmp_path / "out").iterdir()]


def test_pull_roundtrip(tmp_path: Path, registry_path: Path) -> None:
    reg = open_registry(str(registry_path))
    reg.register_version(_req(tmp_path, data=b"abc" * 1000))
    (out,) = reg.pull("demo/Q8_0", tmp_path / "out")
    assert hashlib.sha256(out.read_bytes()).hexdigest() == hashlib.sha256(b"abc" * 1000).hexdigest()


def test_states_have_legal_transitions_only(tmp_path: Path, registry_path: Path) -> None:
    reg = open_registry(str(registry_path))
    reg.register_version(_req(tmp_path))
    assert reg.get_version("demo/Q8_0@1").state == "candidate"
    with pytest.raises(IllegalTransitionError, match="candidate to published"):
        reg.set_state("demo/Q8_0@1", VersionState.PUBLISHED)
    reg.set_state("demo/Q8_0@1", VersionState.VALIDATED)
    assert reg.set_state("demo/Q8_0@1", VersionState.PUBLISHED).state == "published"


def test_unknown_references(registry_path: Path) -> None:
    reg = open_registry(str(registry_path))
    for ref in ("nope/Q8_0", "demo/Q8_0@7"):
        with pytest.raises(NotFoundError):
            reg.get_version(ref)


def test_registry_location_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "reg"
    f.write_text("x")
    with pytest.raises(RegistryPathError, match="is a file"):
        open_registry(str(f))
    assert f.read_text() == "x"


def test_results_attach_to_versions(tmp_path: Path, registry_path: Path) -> None:
    reg = open_registry(str(registry_path))
    reg.register_version(_req(tmp_path))
    reg.add_result("demo/Q8_0@1", {"kind": "quality", "engine": "llama.cpp", "status": "ok",
                                   "metrics": {"ppl": 12.5}, "window_set_id": "w"})
    (r,) = reg.get_version("demo/Q8_0@1").results
    assert r.metrics == {"ppl": 12.5} and r.window_set_id == "w"
