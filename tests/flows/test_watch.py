"""``quantyard watch --once`` and ``quantyard convert --recipe``: a recipe's source is rebuilt exactly when
its content (a folder's hash, a hub commit) changed since the last registered build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from tests.conftest import HUB_REPO as REPO
from tests.factories import copy_checkpoint
from tests.hub_emulator import HubEmulator


def _recipe(path: Path, source: Path, **extra: object) -> Path:
    data = {"name": "watched", "source": source.name, "formats": {"gguf": {"types": ["Q8_0"]}},
            "eval": {"enabled": False}, **extra}
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def _perturb_weights(ckpt: Path) -> None:
    """A new 'commit' of the checkpoint: one weight tensor changes slightly (still a valid model)."""
    from safetensors.torch import load_file, save_file

    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if n.endswith("mlp.down_proj.weight"))
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, path, metadata={"format": "pt"})


def _tick(recipe: Path, registry: Path) -> list[dict]:
    result = CliRunner().invoke(app, ["watch", str(recipe), "--once", "--embedded", "--registry", str(registry),
                                      "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("["):])


def test_watch_builds_once_per_content_change(tmp_path: Path, demo_model: Path, prefect_harness: None) -> None:
    from registry import open_registry

    source = copy_checkpoint(demo_model, tmp_path / "checkpoint")
    recipe = _recipe(tmp_path / "recipe.yaml", source)
    registry = tmp_path / "registry"

    first = _tick(recipe, registry)
    assert [t["changed"] for t in first] == [True] and first[0]["reasons"] == ["Q8_0: not built yet"]
    assert _tick(recipe, registry)[0]["changed"] is False  # nothing moved: no build

    _perturb_weights(source)
    third = _tick(recipe, registry)
    assert third[0]["changed"] is True and third[0]["identity"] != first[0]["identity"]
    assert third[0]["reasons"] == [f"Q8_0: latest watched/Q8_0@1 was built from {first[0]['identity']}"]
    assert _tick(recipe, registry)[0]["changed"] is False

    reg = open_registry(str(registry))
    versions = reg.list_versions("watched", "Q8_0")
    assert [v.number for v in versions] == [1, 2]  # exactly one new build for the one change
    assert [v.source["identity"] for v in versions] == [first[0]["identity"], third[0]["identity"]]


def test_convert_recipe_and_policy_promotion(tmp_path: Path, demo_model: Path, prefect_harness: None) -> None:
    from registry import open_registry

    source = copy_checkpoint(demo_model, tmp_path / "checkpoint")
    recipe = _recipe(tmp_path / "recipe.yaml", source, eval={"max_windows": 4, "speed": False},
                     policy={"classes": {"Q8": {"max_kld": 0.01}}, "promote": True})
    registry = tmp_path / "registry"
    result = CliRunner().invoke(app, ["convert", "--recipe", str(recipe), "--registry", str(registry), "--json"])
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.output[result.output.index("["):])
    (verdict,) = run["verdicts"]
    assert verdict["variant"] == "Q8_0" and verdict["passed"] and verdict["promoted"]
    assert open_registry(str(registry)).get_version("watched/Q8_0").state == "validated"

    # A policy the variant fails: exit code 3 (engine/quality), the version stays a candidate.
    strict = _recipe(tmp_path / "strict.yaml", source, name="strict", eval={"max_windows": 4, "speed": False},
                     policy={"classes": {"Q8": {"max_kld": 1e-12}}, "promote": True})
    result = CliRunner().invoke(app, ["convert", "--recipe", str(strict), "--registry", str(registry), "--json"])
    assert result.exit_code != 0
    (run,) = json.loads(result.output[result.output.index("["):])
    assert run["verdicts"][0]["passed"] is False and "kld_mean" in run["verdicts"][0]["problems"][0]
    assert open_registry(str(registry)).get_version("strict/Q8_0").state == "candidate"


@pytest.mark.parametrize(("edit", "expected"), [
    ({"formats": {"gguf": {"types": ["Q8_0"], "imatrx": True}}}, "formats.gguf.imatrx"),
    ({"formats": {"gguf": {"types": ["Q9_Z"]}}}, "Q9_Z"),
    ({"formats": {}}, "no variants"),
    ({"sources": [{"source": "a/b"}]}, "either `source`"),
    ({"placement": {"formats": {"gguf": "tpu"}}}, "placement.formats.gguf"),
])
def test_bad_recipes_are_named(tmp_path: Path, edit: dict, expected: str) -> None:
    source = tmp_path / "checkpoint"
    source.mkdir()
    recipe = tmp_path / "recipe.yaml"
    data = {"name": "x", "source": source.name, "formats": {"gguf": {"types": ["Q8_0"]}}, **edit}
    recipe.write_text(yaml.safe_dump(data), encoding="utf-8")
    result = CliRunner().invoke(app, ["convert", "--recipe", str(recipe), "--registry", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    assert expected in result.output
    assert not (tmp_path / "r").exists()


def test_watch_rebuilds_a_hub_source_when_its_branch_moves(hub: HubEmulator, tiny_sharded: Path, tmp_path: Path,
                                                            prefect_harness: None) -> None:
    """The ggml-org/convert ``.src_sha`` behaviour, kept by the registry: one model-info call per tick, a build
    only when ``main`` points at a commit no registered version was built from."""
    from registry import open_registry

    first_sha = hub.push(REPO, tiny_sharded)
    recipe = tmp_path / "hub.yaml"
    recipe.write_text(yaml.safe_dump({"source": REPO, "revision": "main", "formats": {"gguf": {"types": ["Q8_0"]}},
                                      "eval": {"enabled": False}}), encoding="utf-8")
    registry = tmp_path / "registry"
    assert _tick(recipe, registry)[0]["identity"] == f"hub:{REPO}@{first_sha}"
    hub.requests.clear()
    assert _tick(recipe, registry)[0]["changed"] is False
    assert [r.kind for r in hub.requests] == ["info"]  # the branch was checked, nothing downloaded

    second_sha = hub.push(REPO, tiny_sharded, extra={"README.md": b"# a new commit on main\n"})
    moved = _tick(recipe, registry)
    assert moved[0]["changed"] is True and moved[0]["identity"] == f"hub:{REPO}@{second_sha}"
    versions = open_registry(str(registry)).list_versions(REPO, "Q8_0")
    assert [(v.number, v.source["commit"]) for v in versions] == [(1, first_sha), (2, second_sha)]
