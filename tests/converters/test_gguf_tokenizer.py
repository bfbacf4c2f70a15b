"""Tokenizer parity: the GGUF must tokenize the probe text, and the run's evaluation and calibration texts,
exactly like the checkpoint's HF tokenizer. The demo passes; a GGUF whose vocabulary was edited with gguf-py
is caught with the first differing position, fails its variant, and is registered only with
--allow-tokenizer-mismatch (recorded); a real checkpoint whose pre-tokenizer does not split digits, converted
to a GGUF whose pre-tokenizer does, passes the probe and is caught on the text. The types made from one base
carry its tokenizer metadata byte for byte (same digest), so the check runs once for them; a GGUF whose
tokenizer metadata differs, or other texts, are checked again, and a mismatch is never reused."""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from converters.base import BuildContext
from converters.checkpoint import load_checkpoint
from converters.gguf.converter import PARITY_DIR, GGUFConverter
from converters.gguf.header import read_header
from converters.gguf.tokenizer import PROBE_TEXT, check_parity, hf_tokens
from converters.source import resolve_source
from flows.quantize import convert_flow
from flows.steps import real_checkpoint
from pipeline.config import Settings
from pipeline.errors import TokenizerMismatchError
from pipeline.llama_cpp import llama_cpp_toolchain
from pipeline.plan import EvalSpec, GGUFOptions, Plan, SourceInput, variants_from_flags
from pipeline.real_model import RealRecipe
from pipeline.specs import GGUFSpec
from registry import open_registry
from tests.conftest import make_settings
from tests.factories import copy_checkpoint, gguf_swap_tokens


def _base(demo_model: Path, cfg: Settings) -> Path:
    """The demo's cached F16 base in ``cfg``'s work dir (converted once per session)."""
    ctx = BuildContext(checkpoint=load_checkpoint(demo_model), source=resolve_source(str(demo_model),
                       cache_dir=cfg.cache_dir), model_name="demo", settings=cfg)
    return Path(GGUFConverter(cfg).prepare(ctx, []).paths["base"])


def _swap_pair(demo_model: Path) -> tuple[int, int, int]:
    """Two token ids to swap (one in the probe, one not) and the first probe position the swap touches."""
    ids, _ = hf_tokens(demo_model)
    a = ids[3]
    b = next(i for i in range(3000, 4000) if i not in ids)
    return a, b, ids.index(a)


@pytest.fixture
def shared_work(demo_registry_template: dict[str, object]) -> Path:
    return Path(demo_registry_template["work"])  # type: ignore[arg-type]


def test_demo_gguf_tokenizes_like_hf(demo_model: Path, shared_work: Path, cache_dir: Path, tmp_path: Path) -> None:
    cfg = make_settings(tmp_path / "registry", shared_work, cache_dir)
    record = check_parity(_base(demo_model, cfg), demo_model, python=sys.executable, env=llama_cpp_toolchain(cfg).env(),
                          log_dir=tmp_path, timeout_s=120, allow=False)
    assert record["ok"] is True and record["tokens_hf"] == record["tokens_gguf"] > 100
    assert len(PROBE_TEXT) > 500


def test_edited_vocabulary_is_caught_with_the_position(demo_model: Path, shared_work: Path, cache_dir: Path,
                                                       tmp_path: Path) -> None:
    cfg = make_settings(tmp_path / "registry", shared_work, cache_dir)
    a, b, position = _swap_pair(demo_model)
    crafted = tmp_path / "crafted.gguf"
    gguf_swap_tokens(_base(demo_model, cfg), crafted, a, b)
    with pytest.raises(TokenizerMismatchError) as info:
        check_parity(crafted, demo_model, python=sys.executable, env=llama_cpp_toolchain(cfg).env(),
                     log_dir=tmp_path, timeout_s=120, allow=False)
    err = info.value
    assert err.position == position and f"position {position}" in str(err)
    # the GGUF gives b where HF gives a (both shown, with their neighbours)
    offset = position - max(0, position - 4)
    assert err.expected[offset] == a and err.found[offset] == b
    assert "--allow-tokenizer-mismatch" in str(err)


def test_a_first_token_only_one_side_adds_is_named_with_what_to_do(demo_model: Path, shared_work: Path,
                                                                   cache_dir: Path, tmp_path: Path) -> None:
    """Not crafted: the demo checkpoint without tokenizer.json, as SentencePiece repos often are. Its
    tokenizer_config.json sets no add_bos_token, and transformers 5 builds its tokenizer from tokenizer.model
    adding no BOS, while the GGUF adds one. The error says that, and which setting decides it."""
    cfg = make_settings(tmp_path / "registry", shared_work, cache_dir)
    spm = copy_checkpoint(demo_model, tmp_path / "spm")
    (spm / "tokenizer.json").unlink()
    with pytest.raises(TokenizerMismatchError) as info:
        check_parity(_base(demo_model, cfg), spm, python=sys.executable, env=llama_cpp_toolchain(cfg).env(),
                     log_dir=tmp_path, timeout_s=120, allow=False)
    assert info.value.position == 0 and info.value.found[1:] == info.value.expected[:-1]
    assert info.value.hint is not None and info.value.hint.startswith(
        "only the first token differs: llama.cpp adds '<s>' at the start and the HF tokenizer does not; set "
        "add_bos_token in the checkpoint's tokenizer_config.json"), info.value.hint


def test_mismatch_fails_the_variant_unless_allowed(demo_model: Path, shared_work: Path, cache_dir: Path,
                                                   tmp_path: Path, registry_path: Path,
                                                   prefect_harness: None) -> None:
    cfg = make_settings(registry_path, tmp_path / "work", cache_dir)
    shared_base = _base(demo_model, make_settings(registry_path, shared_work, cache_dir))
    private = cfg.work_root / "gguf-base" / shared_base.parent.name
    shutil.copytree(shared_base.parent, private)  # same key: the flow finds this base and converts nothing
    a, b, position = _swap_pair(demo_model)
    crafted = private / "crafted.tmp"
    gguf_swap_tokens(private / shared_base.name, crafted, a, b)
    crafted.replace(private / shared_base.name)

    plan = Plan(source=SourceInput(source=str(demo_model)), model_name="demo", variants=variants_from_flags(
        gguf="Q8_0"), eval=EvalSpec(enabled=False))
    failed = convert_flow(plan, cfg)
    (outcome,) = failed.variants
    assert failed.count("convert_base") == 0
    assert outcome.status == "failed" and outcome.error_type == "TokenizerMismatchError"
    assert f"position {position}" in (outcome.error or "")
    # nothing registered: the model holds only its source's records (the stage ledger, the shared base)
    assert open_registry(cfg.registry).list_variants("demo") == []

    lenient = plan.gguf.model_copy(update={"allow_tokenizer_mismatch": True})
    allowed = convert_flow(plan.model_copy(update={"gguf": lenient}), cfg)
    assert allowed.ok and allowed.variants[0].status == "registered"
    parity = open_registry(cfg.registry).get_version("demo/Q8_0").lineage["parameters"]["tokenizer_parity"]
    assert parity["ok"] is False and parity["allowed_by_override"] is True
    assert parity["first_difference"] == position


def test_demo_gguf_tokenizes_its_texts_like_hf(demo_model: Path, shared_work: Path, cache_dir: Path,
                                               tmp_path: Path) -> None:
    cfg = make_settings(tmp_path / "registry", shared_work, cache_dir)
    texts = {name: (demo_model / name).read_text(encoding="utf-8") for name in ("eval.txt", "calibration.txt")}
    record = check_parity(_base(demo_model, cfg), demo_model, python=sys.executable, env=llama_cpp_toolchain(cfg).env(),
                          log_dir=tmp_path, timeout_s=120, allow=False, texts=texts)
    assert record["ok"] is True and set(record["texts"]) == {"probe", *texts}
    assert all(r["tokens_hf"] == r["tokens_gguf"] > 10_000 for k, r in record["texts"].items() if k != "probe")


@pytest.mark.slow
def test_checkpoint_without_digit_split_is_caught_on_the_text(cache_dir: Path, tmp_path: Path,
                                                              registry_path: Path, prefect_harness: None) -> None:
    """SmolLM2 with the bare ByteLevel pre-tokenizer transformers writes converts to a GGUF whose pre-type is
    llama.cpp's ``smollm`` (digits split first). The probe agrees; the calibration text (English Wikipedia)
    does not ("\\n\\n2007": HF gives two newline tokens, llama.cpp one), so the variant fails and nothing is
    registered."""
    broken = real_checkpoint(Settings(cache_dir=cache_dir), RealRecipe(fix_pretokenizer=False))
    cfg = make_settings(registry_path, tmp_path / "work", cache_dir)
    plan = Plan(source=SourceInput(source=str(broken)), model_name="smol-unfixed",
                variants=variants_from_flags(gguf="BF16"), eval=EvalSpec(enabled=False))
    report = convert_flow(plan, cfg)
    (outcome,) = report.variants
    assert outcome.status == "failed" and outcome.error_type == "TokenizerMismatchError", outcome
    assert "in the text checkpoint:calibration.txt" in (outcome.error or "")
    assert "'\\n\\n'" in (outcome.error or "") and "'Ċ', 'Ċ'" in (outcome.error or "")  # one token vs two
    assert open_registry(cfg.registry).list_variants("smol-unfixed") == []  # nothing registered
    gguf = next((cfg.work_root / "gguf-base").glob("*/smol-unfixed-BF16.gguf"))
    probe_only = check_parity(gguf, broken, python=sys.executable, env=llama_cpp_toolchain(cfg).env(), log_dir=tmp_path,
                              timeout_s=120, allow=False)
    assert probe_only["ok"] is True  # what a probe-only check (the old one) let through


def _demo_ctx(demo_model: Path, cfg: Settings) -> BuildContext:
    texts = {"checkpoint:eval.txt": (demo_model / "eval.txt").read_text(encoding="utf-8")}
    return BuildContext(checkpoint=load_checkpoint(demo_model), source=resolve_source(str(demo_model),
                        cache_dir=cfg.cache_dir), model_name="demo", settings=cfg, texts=texts)


def _tokenize_logs(folder: Path) -> list[Path]:
    """The logs of llama.cpp tokenizer workers started for a build into ``folder``."""
    return sorted(folder.glob("tokenize-*.err"))


def test_types_of_one_base_check_the_tokenizer_once(demo_model: Path, settings: Settings, tmp_path: Path) -> None:
    conv = GGUFConverter(settings)
    ctx = _demo_ctx(demo_model, settings)
    prepared = conv.prepare(ctx, [])
    base = Path(prepared.paths["base"])
    on_base = f"identical tokenizer metadata, checked on {base.name}"
    first = conv.build(ctx, prepared, GGUFSpec(type="Q8_0"), tmp_path / "Q8_0").parameters["tokenizer_parity"]
    # checked on the base beside llama-quantize, and not again on the file (one llama.cpp tokenizer, the base's)
    assert first["ok"] is True and first["checked"] == on_base
    assert [p.name for p in _tokenize_logs(tmp_path / "Q8_0")] == [f"tokenize-{base.stem}.err"]
    # a fresh converter (the record is a file under the work dir, as for another process)
    again = GGUFConverter(settings).build(ctx, prepared, GGUFSpec(type="Q4_K_M"), tmp_path / "Q4_K_M")
    second = again.parameters["tokenizer_parity"]
    assert _tokenize_logs(tmp_path / "Q4_K_M") == []  # no llama.cpp tokenizer started
    assert second["checked"] == on_base
    digest = read_header(base).tokenizer_sha256
    assert second["tokenizer_sha256"] == first["tokenizer_sha256"] == digest
    assert read_header(next(iter(again.files.values()))).tokenizer_sha256 == digest
    assert {k: v for k, v in second.items() if k != "checked"} == {k: v for k, v in first.items() if k != "checked"}
    # other texts are checked
    other = replace(ctx, texts={"other": "Other text: 1234567 and 3.5e-10.\n\n2007 was a year."})
    third = conv.build(other, prepared, GGUFSpec(type="Q2_K"), tmp_path / "Q2_K").parameters["tokenizer_parity"]
    assert third["checked"] == on_base and set(third["texts"]) == {"probe", "other"}
    assert [p.name for p in _tokenize_logs(tmp_path / "Q2_K")] == [f"tokenize-{base.stem}.err"]
    # the base's own type (a copy of the base: no quantization to overlap) finds the base's record by digest
    assert conv.build(ctx, prepared, GGUFSpec(type=str(prepared.meta["base_type"])), tmp_path / "base").parameters[
        "tokenizer_parity"]["checked"] == on_base


def test_other_tokenizer_metadata_is_checked_and_a_mismatch_never_reused(demo_model: Path, settings: Settings,
                                                                         tmp_path: Path) -> None:
    conv = GGUFConverter(settings)
    ctx = _demo_ctx(demo_model, settings)
    prepared = conv.prepare(ctx, [])
    good = conv.build(ctx, prepared, GGUFSpec(type="Q8_0"), tmp_path / "Q8_0").parameters["tokenizer_parity"]
    records = settings.work_root / PARITY_DIR
    assert good["ok"] is True and len(list(records.glob("*.json"))) == 1
    # the base now carries a vocabulary with two entries swapped: its types have another tokenizer digest
    base = Path(prepared.paths["base"])
    a, b, position = _swap_pair(demo_model)
    crafted = base.with_name("crafted.tmp")
    gguf_swap_tokens(base, crafted, a, b)
    crafted.replace(base)
    assert read_header(base).tokenizer_sha256 != good["tokenizer_sha256"]
    with pytest.raises(TokenizerMismatchError) as info:
        conv.build(ctx, prepared, GGUFSpec(type="Q4_K_M"), tmp_path / "Q4_K_M")
    assert info.value.position == position
    # found on the base beside llama-quantize (that error dropped: a mismatch is never recorded), then on the
    # file itself, whose error is the one raised
    assert [p.name for p in _tokenize_logs(tmp_path / "Q4_K_M")] == [f"tokenize-{base.stem}.err",
                                                                      "tokenize-demo-Q4_K_M.err"]
    assert "demo-Q4_K_M" in str(info.value)
    assert len(list(records.glob("*.json"))) == 1  # nothing recorded for the mismatch
    # allowed, each such type is still checked (and says so): a mismatch is not recorded as agreement
    lenient = GGUFConverter(settings, GGUFOptions(allow_tokenizer_mismatch=True))
    for t in ("Q4_K_M", "Q2_K"):
        parity = lenient.build(ctx, prepared, GGUFSpec(type=t), tmp_path / f"allowed-{t}").parameters[
            "tokenizer_parity"]
        assert parity["ok"] is False and parity["allowed_by_override"] is True and parity["checked"] == "this file"
        assert parity["first_difference"] == position and _tokenize_logs(tmp_path / f"allowed-{t}")
    assert len(list(records.glob("*.json"))) == 1
