"""Hub sources against a Hub emulator on loopback (tests/hub_emulator.py), with the real huggingface_hub
client: revision → commit SHA, exactly the needed files into the HF cache, no second download, offline
use of the cache, gated and private repos, and a conversion of a hub source through the flow."""

from __future__ import annotations

from pathlib import Path

import pytest

from converters.source import HubOptions, resolve_source
from flows.quantize import convert_flow
from pipeline.config import Settings
from pipeline.errors import SourceAccessError, SourceNotFoundError, UnsafeSourceError
from pipeline.plan import EvalSpec, Plan, SourceInput, variants_from_flags
from registry import open_registry
from tests.conftest import HUB_REPO as REPO
from tests.conftest import make_settings
from tests.hub_emulator import HubEmulator


def _settings(tmp_path: Path, registry_path: Path, cache_dir: Path) -> Settings:
    """Settings built from the environment (as the CLI does), so HF_* come from the standard variables."""
    return make_settings(registry_path, tmp_path / "work", cache_dir)


def _resolve(cfg: Settings, revision: str | None = "main", repo: str = REPO) -> object:
    hub = HubOptions(endpoint=cfg.hf_endpoint, cache_dir=cfg.hf_cache_dir, offline=cfg.hf_offline)
    return resolve_source(repo, revision=revision, cache_dir=cfg.cache_dir, hub=hub)


def test_revision_pinned_to_commit_and_only_needed_files_downloaded(hub: HubEmulator, tiny_sharded: Path,
                                                                   tmp_path: Path, registry_path: Path,
                                                                   cache_dir: Path) -> None:
    decoys = {"consolidated.safetensors": b"\0" * 64, "original/params.json": b"{}", "pytorch_model.bin": b"x"}
    sha = hub.push(REPO, tiny_sharded, extra=decoys)
    cfg = _settings(tmp_path, registry_path, cache_dir)
    assert cfg.hf_endpoint == hub.url and not cfg.hf_offline

    src = _resolve(cfg)
    assert src.commit == sha and src.revision == "main" and src.identity == f"hub:{REPO}@{sha}"  # type: ignore[attr-defined]
    folder = Path(src.path)  # type: ignore[attr-defined]
    assert folder.name == sha and folder.is_relative_to(tmp_path / "hf-cache")
    shards = sorted(p.name for p in tiny_sharded.glob("model-*.safetensors"))
    assert len(shards) >= 2
    got = sorted(p.name for p in folder.iterdir())
    assert got == sorted(p.name for p in tiny_sharded.iterdir())  # no decoys, no nested files
    downloads = [r.path for r in hub.requests if r.kind == "file" and r.method == "GET"]
    assert len(downloads) == len(got)

    hub.requests.clear()
    assert _resolve(cfg) == src
    assert [r.kind for r in hub.requests] == ["info"]  # one revision lookup, no download

    hub.requests.clear()
    assert _resolve(cfg, revision=sha) == _resolve(cfg, revision=sha)
    assert hub.requests == []  # pinned by commit and cached: the hub is not asked at all

    new_sha = hub.push(REPO, tiny_sharded, extra={"README.md": b"# new revision\n"})
    hub.requests.clear()
    moved = _resolve(cfg)
    assert moved.commit == new_sha != sha  # type: ignore[attr-defined]
    assert [r.path.rsplit("/", 1)[-1] for r in hub.requests if r.kind == "file" and r.method == "GET"] == [
        "README.md"]  # unchanged files are linked from the blobs already in the cache


def test_offline_uses_the_cached_snapshot(hub: HubEmulator, tiny_sharded: Path, tmp_path: Path,
                                          registry_path: Path, cache_dir: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    sha = hub.push(REPO, tiny_sharded)
    online = _resolve(_settings(tmp_path, registry_path, cache_dir))
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline_cfg = _settings(tmp_path, registry_path, cache_dir)
    assert offline_cfg.hf_offline
    assert _resolve(offline_cfg) == online and online.commit == sha  # type: ignore[attr-defined]
    assert hub.requests == []
    with pytest.raises(SourceNotFoundError, match=r"not .*in the local HF cache"):
        _resolve(offline_cfg, revision="other-branch")
    with pytest.raises(SourceNotFoundError, match=r"not .*in the local HF cache"):
        _resolve(offline_cfg, repo="tiny-org/never-downloaded")


def test_gated_and_private_repos_use_the_standard_token(hub: HubEmulator, tiny_sharded: Path, tmp_path: Path,
                                                        registry_path: Path, cache_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    hub.push("tiny-org/gated", tiny_sharded, gated=True)
    hub.push("tiny-org/private", tiny_sharded, private=True)
    cfg = _settings(tmp_path, registry_path, cache_dir)
    with pytest.raises(SourceAccessError, match="gated") as gated:
        _resolve(cfg, repo="tiny-org/gated")
    assert "HF_TOKEN" in str(gated.value)
    with pytest.raises(SourceNotFoundError, match="not found"):
        _resolve(cfg, repo="tiny-org/private")
    with pytest.raises(SourceNotFoundError, match="revision 'v9'"):
        _resolve(cfg, revision="v9", repo="tiny-org/gated")
    monkeypatch.setenv("HF_TOKEN", hub.token)  # the standard configuration; nothing passed explicitly
    assert _resolve(cfg, repo="tiny-org/gated").repo_id == "tiny-org/gated"  # type: ignore[attr-defined]
    assert _resolve(cfg, repo="tiny-org/private").repo_id == "tiny-org/private"  # type: ignore[attr-defined]
    assert all(r.status == 200 for r in hub.requests[-3:])


def test_pickle_only_repo_is_refused_before_downloading(hub: HubEmulator, tmp_path: Path, registry_path: Path,
                                                        cache_dir: Path) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    hub.push("tiny-org/pickled", folder)
    with pytest.raises(UnsafeSourceError, match="pickle"):
        _resolve(_settings(tmp_path, registry_path, cache_dir), repo="tiny-org/pickled")
    assert not [r for r in hub.requests if r.kind == "file"]


def test_convert_hub_source_then_rerun_downloads_nothing(hub: HubEmulator, tiny_sharded: Path, tmp_path: Path,
                                                        registry_path: Path, cache_dir: Path,
                                                        prefect_harness: None) -> None:
    sha = hub.push(REPO, tiny_sharded)
    plan = Plan(source=SourceInput(source=REPO, revision="main"), variants=variants_from_flags(gguf="Q8_0"),
                eval=EvalSpec(enabled=False))
    cfg = _settings(tmp_path, registry_path, cache_dir)
    report = convert_flow(plan, cfg)
    assert report.ok and report.count("convert_base") == 1 and report.source["commit"] == sha
    view = open_registry(cfg.registry).get_version(f"{REPO}/Q8_0")
    assert view.source["commit"] == sha and view.lineage["source"]["revision"] == "main"
    assert view.lineage["source"]["identity"] == f"hub:{REPO}@{sha}"

    hub.requests.clear()
    again = convert_flow(plan, cfg)
    assert [r.kind for r in hub.requests] == ["info"]  # the branch is re-resolved; nothing is downloaded
    assert again.count("convert_base") == 0 and [v.status for v in again.variants] == ["reused"]
