"""Registry semantics, on SQLite and on PostgreSQL: immutable versions numbered in order, sha256
dedup, aliases with an audit log, states, lineage both ways, references."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pipeline.errors import (
    IllegalTransitionError,
    IntegrityError,
    InvalidReferenceError,
    NotFoundError,
    RegistryPathError,
)
from pipeline.specs import VersionState
from registry import open_registry
from registry.views import InputView
from tests.registry.conftest import Backend
from tests.registry.helpers import HUB, SRC, TOOL, flip_byte, request


def test_register_is_idempotent_per_build_key(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    v1 = reg.register_version(request(tmp_path))
    again = reg.register_version(request(tmp_path))
    forced = reg.register_version(request(tmp_path, force=True))
    other = reg.register_version(request(tmp_path, key="k2", data=b"other"))
    assert (v1.number, v1.created) == (1, True)
    assert (again.number, again.created) == (1, False)
    assert (forced.number, other.number) == (2, 3)
    assert v1.files[0].sha256 == forced.files[0].sha256  # identical bytes stored once
    assert len(list(reg.blobs.list_blobs())) == 2


def test_identical_files_across_variants_are_stored_once(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    a = reg.register_version(request(tmp_path, name="F16", data=b"same" * 500))
    b = reg.register_version(request(tmp_path, name="BF16", data=b"same" * 500))
    assert a.files[0].sha256 == b.files[0].sha256
    assert [s.key for s in reg.blobs.list_blobs()] == [a.files[0].sha256]


def test_same_filesystem_ingest_links_instead_of_copying(tmp_path: Path, registry_path: Path) -> None:
    reg = open_registry(str(registry_path))
    src = tmp_path / "big.bin"
    src.write_bytes(b"x" * 100_000)
    stored = reg.blobs.put_file(src)
    assert stored.method in ("reflink", "hardlink")
    blob = reg.blobs.local_path(stored.sha256)
    assert blob is not None and stored.sha256 == hashlib.sha256(src.read_bytes()).hexdigest()
    if stored.method == "hardlink":
        assert blob.stat().st_ino == src.stat().st_ino
    assert not list((registry_path / "blobs" / "tmp").iterdir())


def test_blob_layout_and_no_temp_left(tmp_path: Path, registry_path: Path) -> None:
    reg = open_registry(str(registry_path))
    view = reg.register_version(request(tmp_path))
    digest = view.files[0].sha256
    assert (registry_path / "blobs" / "sha256" / digest[:2] / digest).is_file()
    assert not list((registry_path / "blobs" / "tmp").iterdir())


def test_pull_refuses_a_corrupt_blob(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    view = reg.register_version(request(tmp_path))
    blob = reg.blobs.local_path(view.files[0].sha256)
    assert blob is not None
    flip_byte(blob)
    with pytest.raises(IntegrityError, match="corrupt"):
        reg.pull("demo/Q8_0@1", tmp_path / "out")
    assert not list((tmp_path / "out").iterdir())
    _, chunks = reg.open_file("demo/Q8_0@1", "demo-Q8_0.gguf")
    with pytest.raises(IntegrityError):
        b"".join(chunks)


def test_pull_roundtrip_and_ranges(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    data = bytes(range(256)) * 40
    reg.register_version(request(tmp_path, data=data))
    (out,) = reg.pull("demo/Q8_0", tmp_path / "out")
    assert out.read_bytes() == data
    f, chunks = reg.open_file("demo/Q8_0@latest", "demo-Q8_0.gguf", start=100, end=199)
    assert f.size == len(data) and b"".join(chunks) == data[100:200]
    _, tail = reg.open_file("demo/Q8_0", "demo-Q8_0.gguf", start=len(data) - 5)
    assert b"".join(tail) == data[-5:]
    with pytest.raises(InvalidReferenceError):
        reg.open_file("demo/Q8_0", "demo-Q8_0.gguf", start=len(data))
    with pytest.raises(NotFoundError, match="no file"):
        reg.open_file("demo/Q8_0", "nope.gguf")


def test_states_have_legal_transitions_only(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    reg.register_version(request(tmp_path))
    assert reg.get_version("demo/Q8_0@1").state == "candidate"
    with pytest.raises(IllegalTransitionError, match="candidate to published"):
        reg.set_state("demo/Q8_0@1", VersionState.PUBLISHED)
    reg.set_state("demo/Q8_0@1", "validated", by="alice", note="passed gate")
    assert reg.set_state("demo/Q8_0@1", VersionState.PUBLISHED, by="bob").state == "published"
    reg.set_state("demo/Q8_0@1", VersionState.DEPRECATED, by="bob")
    with pytest.raises(IllegalTransitionError, match="final state"):
        reg.set_state("demo/Q8_0@1", VersionState.VALIDATED)
    events = [(e.action, e.actor, e.old, e.new) for e in reg.audit_log("demo", "Q8_0") if e.action == "state"]
    assert events == [("state", "bob", "published", "deprecated"), ("state", "bob", "validated", "published"),
                      ("state", "alice", "candidate", "validated")]


def test_aliases_move_and_are_audited(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    for key in ("k1", "k2", "k3"):
        reg.register_version(request(tmp_path, key=key, data=key.encode()))
    assert reg.aliases("demo", "Q8_0") == {"latest": 3}
    reg.set_alias("demo/Q8_0@1", "production", by="alice", note="first rollout")
    assert reg.get_version("demo/Q8_0@production").number == 1
    reg.set_alias("demo/Q8_0@2", "production", by="bob")
    assert reg.get_version("demo/Q8_0@production").number == 2
    assert reg.get_version("demo/Q8_0@2").aliases == ["production"]
    assert reg.list_variants("demo")[0].aliases == {"latest": 3, "production": 2}
    reg.delete_alias("demo", "Q8_0", "production", by="carol")
    with pytest.raises(NotFoundError, match="production"):
        reg.get_version("demo/Q8_0@production")
    moves = [(e.actor, e.action, e.old, e.new, e.note) for e in reg.audit_log("demo", "Q8_0")
             if e.name == "production"]
    assert moves == [("carol", "alias.delete", "2", None, None), ("bob", "alias.set", "1", "2", None),
                     ("alice", "alias.set", None, "1", "first rollout")]
    latest_moves = [(e.old, e.new) for e in reg.audit_log("demo", "Q8_0") if e.name == "latest"]
    assert latest_moves == [("2", "3"), ("1", "2"), (None, "1")]


def test_alias_rules(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    reg.register_version(request(tmp_path))
    with pytest.raises(IllegalTransitionError, match="maintained by the registry"):
        reg.set_alias("demo/Q8_0@1", "latest")
    with pytest.raises(InvalidReferenceError):
        reg.set_alias("demo/Q8_0@1", "12")
    with pytest.raises(NotFoundError):
        reg.set_alias("demo/Q8_0@9", "production")
    with pytest.raises(NotFoundError):
        reg.delete_alias("demo", "Q8_0", "production")


def test_lineage_both_directions(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    calib = InputView(kind="calibration", ref="sha256:" + "cd" * 32, name="calibration.txt", sha256="cd" * 32)
    a = reg.register_version(request(tmp_path, name="Q4_K_M", source=HUB, inputs=[calib]))
    b = reg.register_version(request(tmp_path, name="Q8_0", source=HUB, data=b"q8"))
    reg.register_version(request(tmp_path, name="Q8_0", source=SRC, key="other", data=b"local"))
    up = reg.lineage(a.ref)
    assert up.source["commit"] == HUB.commit and up.source["repo_id"] == "acme/tiny"
    assert up.tool == TOOL and any(i.kind == "calibration" and i.name == "calibration.txt" for i in up.inputs)
    assert up.environment["registered_by"]
    down = reg.derived_from(HUB.identity)
    assert [v.ref for v in down] == [a.ref, b.ref]
    assert [v.ref for v in reg.derived_from("cd" * 8, kind="calibration")] == [a.ref]
    assert len(reg.derived_from("llama.cpp@", kind="tool")) == 3
    with pytest.raises(InvalidReferenceError):
        reg.derived_from("ab")


def test_versions_are_numbered_per_variant_and_listed(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    reg.register_version(request(tmp_path, name="Q8_0"))
    reg.register_version(request(tmp_path, name="Q4_K_M", data=b"q4"))
    reg.register_version(request(tmp_path, name="Q4_K_M", key="k2", data=b"q4b"))
    reg.register_version(request(tmp_path, model="acme/other", name="Q8_0", data=b"o"))
    assert [v.number for v in reg.list_versions("demo", "Q4_K_M")] == [1, 2]
    models = reg.list_models(architecture="LlamaForCausalLM", format="gguf")
    assert [(m.name, m.variants, m.versions, m.formats) for m in models] == [
        ("acme/other", 1, 1, ["gguf"]), ("demo", 2, 3, ["gguf"])]
    assert reg.list_models(format="awq") == [] and reg.list_models(architecture="Mamba") == []
    variants = {v.name: (v.latest, v.latest_state) for v in reg.list_variants("demo")}
    assert variants == {"Q4_K_M": (2, "candidate"), "Q8_0": (1, "candidate")}


def test_unknown_references(backend: Backend) -> None:
    reg = backend.open()
    for ref in ("nope/Q8_0", "demo/Q8_0@7"):
        with pytest.raises(NotFoundError):
            reg.get_version(ref)
    with pytest.raises(InvalidReferenceError):
        reg.get_version("no-variant")


def test_registry_location_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "reg"
    f.write_text("x")
    with pytest.raises(RegistryPathError, match="is a file"):
        open_registry(str(f))
    assert f.read_text() == "x"


def test_results_attach_to_versions(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    reg.register_version(request(tmp_path))
    reg.add_result("demo/Q8_0@1", {"kind": "quality", "engine": "llama.cpp", "status": "ok",
                                   "metrics": {"ppl": 12.5}, "window_set_id": "w"})
    (r,) = reg.get_version("demo/Q8_0@1").results
    assert r.metrics == {"ppl": 12.5} and r.window_set_id == "w"
