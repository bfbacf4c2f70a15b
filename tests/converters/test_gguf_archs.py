"""Real-world checkpoint shapes through the real flow: sharded bf16 Mistral, tied-embedding Llama, and the
other architectures llama.cpp's converter supports, a MoE among them (Mixtral: its experts are stored one linear
each, which transformers 5 fuses as it loads; tiny random weights, demo tokenizer, no downloads).

The random checkpoints use a large init range so their next-token distributions are peaked (entropy
about 2 nats rather than the uniform 8.3): a wrongly converted model then shows up as a large KLD
against the transformers reference instead of hiding inside near-uniform noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import ExpertGatingFuncType, GGUFReader, LlamaFileType

from converters.base import BuildContext
from converters.checkpoint import load_checkpoint
from converters.gguf.converter import GGUFConverter, converter_config, llama_cpp_divergences
from converters.source import resolve_source
from flows.quantize import convert_flow
from pipeline.config import Settings
from pipeline.errors import ConversionError, TokenizerMismatchError
from pipeline.plan import EvalSpec, Plan, SourceInput, SpeedSpec, variants_from_flags
from pipeline.specs import GGUFSpec
from registry import open_registry
from tests.factories import arch_checkpoint, random_checkpoint

PEAKED = {"initializer_range": 0.3}
TINY_EVAL = EvalSpec(window=128, stride=128, max_windows=4, speed=SpeedSpec(enabled=False))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {
        "mistral": arch_checkpoint(root / "tiny-mistral", demo_model, "mistral", dtype="bfloat16",
                                   max_shard_size="1MB", layers=2, **PEAKED),
        "llama-tied": arch_checkpoint(root / "tiny-llama-tied", demo_model, "llama", tie=True, layers=2, **PEAKED),
    }


def _convert(path: Path, name: str, types: str, settings: Settings) -> object:
    plan = Plan(source=SourceInput(source=str(path)), model_name=name, variants=variants_from_flags(gguf=types),
                eval=TINY_EVAL)
    return convert_flow(plan, settings)


def _assert_evaluated_close(view: object) -> dict[str, float]:
    quality = next(r for r in view.results if r.kind == "quality")  # type: ignore[attr-defined]
    assert quality.status == "ok"
    m = quality.metrics
    print(view.ref, {k: m[k] for k in ("ppl", "kld_mean", "top1_agreement")})  # type: ignore[attr-defined]
    # A correct Q8_0 conversion stays within about 0.1 nat of the fp32 reference here (top-1 agreement
    # 0.8-0.95: the large init makes activations large, which 8-bit rounding feels); a broken one (wrong
    # tensor mapping, dropped head, bad dtype) is off by nats, e.g. 15 nats for an untied Gemma, whose
    # lm_head llama.cpp drops, with top-1 agreement near chance (1/4096).
    assert m["kld_mean"] < 1.0 and m["top1_agreement"] > 0.5, m
    return m


def test_sharded_bf16_mistral_converts_evaluates_registers(checkpoints: dict[str, Path], settings: Settings,
                                                           prefect_harness: None) -> None:
    ckpt = checkpoints["mistral"]
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2 and json.loads((ckpt / "config.json").read_text())[
        "dtype"] == "bfloat16"
    report = _convert(ckpt, "tiny-mistral", "Q8_0", settings)
    assert report.ok and report.count("convert_base") == 1, report  # type: ignore[attr-defined]
    reg = open_registry(settings.registry)
    view = reg.get_version("tiny-mistral/Q8_0")
    assert view.lineage["parameters"]["base_type"] == "BF16"  # matches the bf16 source
    assert view.lineage["source"]["architecture"] == "MistralForCausalLM"
    assert view.lineage["source"]["torch_dtype"] == "bfloat16"
    assert view.lineage["parameters"]["tokenizer_parity"]["ok"] is True
    (base,) = (settings.work_root / "gguf-base").glob("*/tiny-mistral-BF16.gguf")
    assert GGUFReader(str(base)).get_field("general.file_type").contents() == LlamaFileType.MOSTLY_BF16
    _assert_evaluated_close(view)


def test_tied_embedding_llama_converts_evaluates_registers(checkpoints: dict[str, Path], settings: Settings,
                                                           prefect_harness: None) -> None:
    ckpt = checkpoints["llama-tied"]
    assert "lm_head.weight" not in load_checkpoint(ckpt).tensors  # tied: only the embedding is stored
    report = _convert(ckpt, "tiny-llama-tied", "Q8_0", settings)
    assert report.ok, report
    reg = open_registry(settings.registry)
    view = reg.get_version("tiny-llama-tied/Q8_0")
    assert view.lineage["parameters"]["base_type"] == "F16"
    names = {t.name for t in GGUFReader(str(reg.blobs.path_of(view.files[0].sha256))).tensors}
    assert "token_embd.weight" in names and "output.weight" not in names  # llama.cpp reuses the embedding
    _assert_evaluated_close(view)


#: Each architecture with the tokenizer llama.cpp's converter takes for it: the demo's SentencePiece one, or,
#: where it reads a GPT-2-style BPE vocabulary, the real checkpoint's SmolLM2 tokenizer (one it knows). "phi" has
#: Phi-2's shapes.
ARCH_TOKENIZERS = [*((arch, "demo_model") for arch in ("qwen3", "gemma", "phi3", "mixtral")),
                   *((arch, "real_model") for arch in ("phi", "stablelm", "olmo2", "granite", "qwen2_moe", "olmoe"))]


@pytest.mark.parametrize(("arch", "tokenizer"), ARCH_TOKENIZERS)
def test_other_architectures_convert_with_tokenizer_parity(arch: str, tokenizer: str, request: pytest.FixtureRequest,
                                                           tmp_path: Path, settings: Settings,
                                                           prefect_harness: None) -> None:
    ckpt = arch_checkpoint(tmp_path / f"tiny-{arch}", request.getfixturevalue(tokenizer), arch, layers=1, **PEAKED)
    report = _convert(ckpt, f"tiny-{arch}", "Q8_0", settings)
    assert report.ok, report
    view = open_registry(settings.registry).get_version(f"tiny-{arch}/Q8_0")
    assert view.lineage["parameters"]["tokenizer_parity"]["ok"] is True
    _assert_evaluated_close(view)


def test_qwen2_with_a_sentencepiece_tokenizer_is_caught_by_parity(tmp_path: Path, demo_model: Path,
                                                                 settings: Settings) -> None:
    """Not crafted: transformers 5 always loads Qwen2Tokenizer (byte-level BPE) for model_type qwen2, while
    llama.cpp's converter takes the SentencePiece tokenizer.model it finds. The GGUF converts and loads,
    but tokenizes differently — exactly the silent failure the check exists for."""
    ckpt = arch_checkpoint(tmp_path / "tiny-qwen2", demo_model, "qwen2", layers=1)
    conv = GGUFConverter(settings)
    ctx = BuildContext(checkpoint=load_checkpoint(ckpt), source=resolve_source(str(ckpt), cache_dir=settings.cache_dir),
                       model_name="tiny-qwen2", settings=settings)
    conv.check(ctx.checkpoint, [])
    prepared = conv.prepare(ctx, [])
    with pytest.raises(TokenizerMismatchError) as info:
        conv.build(ctx, prepared, GGUFSpec(type="Q8_0"), tmp_path / "out")
    assert info.value.position >= 1 and f"position {info.value.position}" in str(info.value)
    assert info.value.expected != info.value.found


def _pythia_spelling(ckpt: Path) -> Path:
    """Rewrite a GPT-NeoX config.json as Pythia's is written (transformers 4): ``rotary_pct`` and
    ``rotary_emb_base`` at the top, no ``rope_parameters``."""
    cfg = json.loads((ckpt / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.update(rotary_pct=rope["partial_rotary_factor"], rotary_emb_base=rope["rope_theta"])
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2))
    return ckpt


def _hub_gpt2_layout(ckpt: Path) -> Path:
    """Rewrite a tied GPT-2 as the Hub's GPT-2 is stored (saved from the base model by an older transformers;
    inferred from its file's size, see README): tensor names without ``transformer.``, each layer's causal-mask
    buffers ``attn.bias`` and ``attn.masked_bias``, and ``n_ctx`` in config.json."""
    import torch
    from safetensors.torch import load_file, save_file

    (weights,) = ckpt.glob("*.safetensors")
    cfg = json.loads((ckpt / "config.json").read_text())
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in load_file(weights).items()
             if k != "lm_head.weight"}
    n = cfg["n_positions"]
    for i in range(cfg["n_layer"]):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, weights, metadata={"format": "pt"})
    (ckpt / "config.json").write_text(json.dumps({**cfg, "n_ctx": n}, indent=2))
    return ckpt


@pytest.mark.parametrize(("arch", "spelling", "key", "value", "overrides"), [
    ("gpt_neox", "transformers 5", "gptneox.rope.dimension_count", 16, {"hparams": {"rotary_pct": 0.25}}),
    ("gpt_neox", "pythia", "gptneox.rope.dimension_count", 16, {"hparams": {"rotary_pct": 0.25}}),
    ("gpt2", "transformers 5", "gpt2.context_length", 1024, {"hparams": {"n_ctx": 1024}}),
    ("gpt2", "hub", "gpt2.context_length", 1024, {"skip_suffixes": [".attn.bias", ".attn.masked_bias"]}),
    ("falcon", "transformers 5", "falcon.attention.head_count_kv", 1, {"hparams": {"num_kv_heads": 1}}),
    ("deepseek_v3", "transformers 5", "deepseek2.expert_gating_func", int(ExpertGatingFuncType.SIGMOID),
     {"hparams": {"scoring_func": "sigmoid"}}),
])
def test_checkpoints_as_transformers_reads_them_reach_llama_cpps_converter(
        arch: str, spelling: str, key: str, value: int, overrides: dict[str, object], tmp_path: Path,
        real_model: Path, settings: Settings, prefect_harness: None) -> None:
    """llama.cpp's converter reads GPT-NeoX's ``rotary_pct`` and GPT-2's ``n_ctx`` from what transformers 5's
    AutoConfig loads, which holds neither (GPTNeoXConfig moves rotary_pct into rope_parameters whichever way
    config.json spells it; save_pretrained no longer writes n_ctx): it stopped on KeyError for every such source.
    For a multi-query Falcon (the config's defaults, as Falcon-7B) it read num_kv_heads, which FalconConfig fills
    with the head count while the model uses one key/value head, and failed reshaping the fused QKV weight. For a
    DeepSeek-V3 it found no scoring_func (transformers 5 writes none: its router is always a sigmoid), wrote no
    gating function, and llama.cpp gated the experts with a softmax: the file converted, loaded and ran another
    model (F32 KLD 0.49 on a tiny one with a routed layer). A
    GPT-2 stored as the Hub's is (base-model names, causal-mask buffers) was refused by the source check as
    "16 tensors missing", and the converter cannot map its buffers. The SmolLM2 tokenizer is one llama.cpp's
    converter knows (the demo's is not a GPT-2 BPE). A wrong rotary fraction is not subtle: converted with
    rotary_pct 1.0 the same GPT-NeoX measured KLD 5.7 and top-1 12 %, against 0.012 and 93 % right."""
    ckpt = arch_checkpoint(tmp_path / f"tiny-{arch}", real_model, arch, layers=1, tie=spelling == "hub", **PEAKED)
    if spelling == "pythia":
        _pythia_spelling(ckpt)
    if spelling == "hub":
        from transformers import AutoModelForCausalLM

        _hub_gpt2_layout(ckpt)
        loaded = load_checkpoint(ckpt)
        assert "h.0.attn.bias" in loaded.tensors  # complete as stored
        assert loaded.n_params == AutoModelForCausalLM.from_pretrained(ckpt).num_parameters()  # masks not counted
    stored = json.loads((ckpt / "config.json").read_text())
    if spelling == "transformers 5":  # as it writes them: neither key the converter reads
        assert not {"rotary_pct", "n_ctx", "scoring_func"} & stored.keys()
    if arch == "falcon":  # saved as the head count, and what the converter would read
        assert stored["multi_query"] and stored["num_kv_heads"] == stored["num_attention_heads"] == 4
    report = _convert(ckpt, f"tiny-{arch}", "Q8_0", settings)
    assert report.ok, report
    reg = open_registry(settings.registry)
    view = reg.get_version(f"tiny-{arch}/Q8_0")
    field = GGUFReader(str(reg.blobs.path_of(view.files[0].sha256))).get_field(key)
    assert field is not None and field.contents() == value  # head 64 x 0.25; GPT-2's n_positions; one KV head
    assert view.lineage["parameters"]["converter_overrides"] == overrides
    # what the converter is told is part of the build key: a variant built before an override changed is rebuilt
    ctx = BuildContext(checkpoint=load_checkpoint(ckpt), source=resolve_source(str(ckpt), cache_dir=settings.cache_dir),
                       model_name=f"tiny-{arch}", settings=settings)
    assert GGUFConverter(settings).build_inputs(ctx, GGUFSpec(type="Q8_0"))["converter_overrides"] == overrides
    _assert_evaluated_close(view)


def test_a_gguf_llama_cpp_cannot_load_fails_before_any_type_is_made(tmp_path: Path, real_model: Path,
                                                                   settings: Settings) -> None:
    """A Phi with grouped K/V heads (transformers' PhiConfig allows them; Phi-1/2 have none) converts, but
    llama.cpp's phi2 has no such heads and refuses the file at load. Before, it was built, registered, and
    each evaluation failed with llama-cpp-python's "Failed to load model from file". The base is now loaded
    (metadata only) right after conversion, so the failure is llama.cpp's own reason and nothing is kept."""
    ckpt = arch_checkpoint(tmp_path / "tiny-phi-gqa", real_model, "phi", layers=1, kv_heads=2, **PEAKED)
    conv = GGUFConverter(settings)
    ctx = BuildContext(checkpoint=load_checkpoint(ckpt), source=resolve_source(str(ckpt), cache_dir=settings.cache_dir),
                       model_name="tiny-phi-gqa", settings=settings)
    conv.check(ctx.checkpoint, [])
    with pytest.raises(ConversionError) as info:
        conv.prepare(ctx, [])
    assert "llama.cpp cannot load the GGUF its converter wrote" in info.value.message
    assert (info.value.cause or "").endswith(
        "llama.cpp cannot load tiny-phi-gqa-F16.gguf: check_tensor_dims: tensor 'blk.0.attn_k.weight' has wrong "
        "shape; expected 256, 256, got 256, 128, 1, 1"), info.value.cause
    kept = [p.name for p in (settings.work_root / "gguf-base").rglob("*") if p.is_file()]
    assert not [n for n in kept if ".gguf" in n or n == "ok"], kept  # the tools' logs only


def test_the_converter_is_given_nothing_where_its_script_finds_what_it_reads() -> None:
    assert converter_config({"model_type": "llama", "rope_parameters": {"partial_rotary_factor": 0.5}}) == {}
    assert converter_config({"model_type": "gpt2", "n_ctx": 2048, "n_positions": 1024}) == {}  # as written
    assert converter_config({"model_type": "gpt_neox", "rotary_pct": 0.5}) == {"rotary_pct": 0.5}
    assert converter_config({"model_type": "gpt_neox"}) == {"rotary_pct": 0.25}  # GPTNeoXConfig's default
    assert converter_config({"model_type": "falcon", "new_decoder_architecture": True, "num_kv_heads": 8}) == {}
    assert converter_config({"model_type": "falcon", "multi_query": False}) == {}  # as falcon-rw-1b
    assert converter_config({"model_type": "deepseek_v3", "scoring_func": "sigmoid"}) == {}  # as DeepSeek's own
    assert converter_config({"model_type": "deepseek_v3"}) == {"scoring_func": "sigmoid"}
    assert converter_config({"model_type": "deepseek_v2"}) == {}  # softmax, llama.cpp's default for deepseek2


def test_a_model_llama_cpp_runs_differently_is_said_with_its_numbers(tmp_path: Path, real_model: Path,
                                                                     settings: Settings, prefect_harness: None) -> None:
    """A Qwen3-MoE whose config says norm_topk_prob false (Qwen3MoeConfig's default) converts and evaluates, but
    llama.cpp's qwen3moe always renormalises the chosen experts' weights: the GGUF runs another model. Its F32
    KLD shows it, and the variant says why. Measured on this shape: 9.8e-4 with norm_topk_prob false, 3.0e-6 with
    true (the same but for that key, through `quantyard convert --gguf F32`)."""
    ckpt = random_checkpoint(tmp_path / "tiny-qwen3moe", real_model, model_type="qwen3_moe", layers=1, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=256, head_dim=64, norm_topk_prob=False,
                             **PEAKED)
    report = _convert(ckpt, "tiny-qwen3moe", "F32", settings)
    assert report.ok, report  # type: ignore[attr-defined]
    (variant,) = report.variants  # type: ignore[attr-defined]
    assert variant.notes == llama_cpp_divergences(json.loads((ckpt / "config.json").read_text()))
    assert len(variant.notes) == 1 and "norm_topk_prob false" in variant.notes[0], variant.notes
    view = open_registry(settings.registry).get_version("tiny-qwen3moe/F32")
    assert view.lineage["parameters"]["llama_cpp_divergences"] == variant.notes
    assert _assert_evaluated_close(view)["kld_mean"] > 1e-4  # not F32 rounding: another model


def test_only_what_llama_cpp_runs_differently_is_said() -> None:
    assert llama_cpp_divergences({"model_type": "llama"}) == []
    assert llama_cpp_divergences({"model_type": "qwen3_moe", "norm_topk_prob": True}) == []  # Qwen's releases
    assert len(llama_cpp_divergences({"model_type": "qwen3_moe"})) == 1  # the config's default: false
    assert llama_cpp_divergences({"model_type": "gemma3_text"}) == []  # 256 and 256, as Gemma 3 1B
    assert llama_cpp_divergences({"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "head_dim": 128, "query_pre_attn_scalar": 168, "num_hidden_layers": 62}}) == []
    (said,) = llama_cpp_divergences({"model_type": "gemma3_text", "head_dim": 64})
    assert "query_pre_attn_scalar 256" in said and "head_dim 64" in said
    released_gpt_oss = {"model_type": "gpt_oss", "swiglu_limit": 7.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}}
    (said,) = llama_cpp_divergences(released_gpt_oss)
    assert "truncate false" in said
