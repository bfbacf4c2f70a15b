"""Tokenizer parity: does the GGUF tokenize like the checkpoint's own Hugging Face tokenizer?

A GGUF carries its own copy of the vocabulary and a pre-tokenizer *name*; when the converter guesses
that name wrong, llama.cpp silently splits text differently from the model's training tokenizer and
quality drops without any error. So every built GGUF tokenizes a probe text (whitespace runs, digits,
contractions, code, several scripts, emoji) and the whole evaluation and calibration texts of the run
with llama.cpp — in one worker subprocess, as the orchestrating process never imports an engine — and
the ids are compared with ``AutoTokenizer``'s. A probe alone misses real cases: SmolLM2 with a bare
ByteLevel pre-tokenizer agrees with llama.cpp's ``smollm`` on every probe line and first differs at
``"\n\n200"``, 160 tokens into an English Wikipedia text. llama.cpp tokenizes a megabyte in about a second.

Every type made from one base carries the base's tokenizer metadata byte for byte, so a result is recorded
under a key (:func:`parity_key`) of everything it depends on: the digest of the GGUF's ``tokenizer.*``
metadata (converters/gguf/header.py), the checkpoint's tokenizer files, the texts, the tool versions on both
sides. A later GGUF with the same key reuses it (:func:`recorded_parity`) instead of starting llama.cpp
again; only agreement is recorded, so a mismatch is found again on every file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConversionError, TokenizerMismatchError
from pipeline.fs import write_atomic
from pipeline.proc import run_logged
from pipeline.texts import text_sha256

WORKER = "converters.gguf.workers.tokenize"
CONTEXT = 4  # tokens shown on each side of the first difference

#: The probe: what pre-tokenizers disagree on. Never edit it silently: its sha256 is recorded in lineage.
PROBE_TEXT = (
    "Hello world! The quick brown fox jumps over the lazy dog. I'm sure they'll say it's fine, don't you?\n"
    "\n"
    "    def area(radius: float) -> float:\n"
    "        return 3.14159 * radius ** 2  # π r²\n"
    "\tTabs\tand  double  spaces,   triple   spaces;\n"
    "Numbers: 7, 42, 1234567, 3.5e-10, 0x1F, 2024-11-30, $1,000,000.00 and 99%.\n"
    "Accents: café, naïve, Ünïcödé, façade, jalapeño. Greek: αβγ. Cyrillic: Привет, мир!\n"
    "CJK: 日本語のテキスト、中文文本。Korean: 안녕하세요. Arabic: مرحبا. Hindi: नमस्ते.\n"
    "Emoji: 🙂👍🏽🚀 and symbols @#^&*()[]{}<>|\\/~`\n"
    "URLs: https://example.com/a?b=c&d=e — and e-mail: someone@example.org\n"
    "  leading spaces, trailing spaces   \n"
    "UPPER lower MiXeD CamelCaseIdentifier snake_case_identifier kebab-case-identifier"
)


PROBE = "probe"

#: Files of a checkpoint the HF tokenizer is built from (config.json too: it can name the tokenizer class).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "special_tokens_map.json", "added_tokens.json", "config.json")


@dataclass(frozen=True)
class ParityReport:
    """What the parity check found on one text; ``record()`` is what lineage keeps."""

    label: str
    sha256: str
    ok: bool
    n_hf: int
    n_gguf: int
    position: int | None
    hf: list[int]
    gguf: list[int]
    hf_pieces: list[str]
    gguf_pieces: list[str]
    char_offset: int | None = None
    snippet: str | None = None

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.ok, "sha256": self.sha256, "tokens_hf": self.n_hf, "tokens_gguf": self.n_gguf}
        if not self.ok:
            out.update({"first_difference": self.position, "char_offset": self.char_offset, "snippet": self.snippet,
                        "hf": self.hf, "gguf": self.gguf, "hf_pieces": self.hf_pieces, "gguf_pieces": self.gguf_pieces})
        return out


def probe_sha256(text: str = PROBE_TEXT) -> str:
    """sha256 of ``text`` (the probe by default), as lineage records texts (``pipeline.texts.text_sha256``)."""
    return text_sha256(text)


@functools.lru_cache(maxsize=16)
def hf_tokens(checkpoint: Path, text: str = PROBE_TEXT) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Ids and pieces of ``text`` with the checkpoint's own tokenizer, special tokens added as by default."""
    ids, pieces, _ = _hf_encode(checkpoint, text)
    return ids, pieces


@functools.lru_cache(maxsize=4)
def _tokenizer(checkpoint: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


@functools.lru_cache(maxsize=16)
def _hf_encode(checkpoint: Path, text: str) -> tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...] | None]:
    """Ids, pieces and each token's start character (None where the tokenizer gives no offsets)."""
    tok = _tokenizer(checkpoint)
    try:
        enc = tok(text, return_offsets_mapping=True)
        starts: tuple[int, ...] | None = tuple(int(a) for a, _ in enc["offset_mapping"])
    except (NotImplementedError, ValueError, TypeError):
        enc, starts = tok(text), None
    ids = [int(i) for i in enc["input_ids"]]
    return tuple(ids), tuple(str(p) for p in tok.convert_ids_to_tokens(ids)), starts


def gguf_tokenize(gguf: Path, texts: Mapping[str, str], *, python: str, env: dict[str, str], log_dir: Path,
                  timeout_s: float, keep: Path | None = None) -> dict[str, tuple[list[int], list[str]]]:
    """Ids and pieces of every text with the GGUF's tokenizer, from one llama.cpp worker subprocess."""
    with tempfile.TemporaryDirectory(dir=log_dir) as tmp:
        output = Path(tmp) / "tokens.json"
        request = {"model": str(gguf), "texts": dict(texts), "output": str(output)}
        res = run_logged([python, "-m", WORKER], log_dir=log_dir, name=f"tokenize-{gguf.stem}", timeout_s=timeout_s,
                         env=env, stdin_text=json.dumps(request), keep=keep)
        if not res.ok or not output.is_file():
            raise ConversionError(f"llama.cpp could not load the tokenizer of {gguf.name}: the worker {res.describe()}",
                                  stderr_tail=res.stderr_tail, hint=f"see the log {res.log}")
        data = json.loads(output.read_text(encoding="utf-8"))
    return {label: ([int(i) for i in r["ids"]], [str(p) for p in r["pieces"]]) for label, r in data.items()}


def gguf_tokens(gguf: Path, *, python: str, env: dict[str, str], log_dir: Path, timeout_s: float,
                text: str = PROBE_TEXT, keep: Path | None = None) -> tuple[list[int], list[str]]:
    """Ids and pieces of one ``text`` with the GGUF's tokenizer (see :func:`gguf_tokenize`)."""
    return gguf_tokenize(gguf, {"text": text}, python=python, env=env, log_dir=log_dir, timeout_s=timeout_s,
                         keep=keep)["text"]


def compare(hf: tuple[list[int], list[str]], gguf: tuple[list[int], list[str]], *, label: str = PROBE,
            text: str = PROBE_TEXT, starts: Sequence[int] | None = None) -> ParityReport:
    """Find the first position where the two tokenizations differ (or where one ends early); on a
    difference, say where in ``text`` it is (character offset and the text around it) when known."""
    (hf_ids, hf_pieces), (gg_ids, gg_pieces) = hf, gguf
    position = next((i for i, (a, b) in enumerate(zip(hf_ids, gg_ids, strict=False)) if a != b), None)
    if position is None and len(hf_ids) != len(gg_ids):
        position = min(len(hf_ids), len(gg_ids))
    lo, hi = (0, 0) if position is None else (max(0, position - CONTEXT), position + CONTEXT + 1)
    char = snippet = None
    if position is not None and starts is not None and position < len(starts):
        char = int(starts[position])
        snippet = text[max(0, char - 30):char + 30]
    return ParityReport(label=label, sha256=probe_sha256(text), ok=position is None, n_hf=len(hf_ids),
                        n_gguf=len(gg_ids), position=position, hf=hf_ids[lo:hi], gguf=gg_ids[lo:hi],
                        hf_pieces=hf_pieces[lo:hi], gguf_pieces=gg_pieces[lo:hi], char_offset=char, snippet=snippet)


def mismatch_error(report: ParityReport, gguf: Path, checkpoint: Path) -> TokenizerMismatchError:
    assert report.position is not None
    start = max(0, report.position - CONTEXT)
    where = "the probe text" if report.label == PROBE else f"the text {report.label}"
    at = f" (character {report.char_offset}, near {report.snippet!r})" if report.char_offset is not None else ""
    return TokenizerMismatchError(
        f"{gguf.name} tokenizes differently from the HF tokenizer of {checkpoint}: first difference in {where} at "
        f"token position {report.position}{at} ({report.n_hf} HF tokens, {report.n_gguf} GGUF tokens). "
        f"From position {start}: HF {report.hf} {report.hf_pieces} vs GGUF {report.gguf} {report.gguf_pieces}",
        position=report.position, expected=report.hf, found=report.gguf,
        hint=_first_token_hint(report) or (
            "the GGUF would silently feed the model different tokens than it was trained on; fix the tokenizer "
            "files (e.g. the pre-tokenizer in tokenizer.json) or llama.cpp's pre-tokenizer detection, or pass "
            "--allow-tokenizer-mismatch to register it anyway (recorded in the lineage)"))


def _first_token_hint(report: ParityReport) -> str | None:
    """What to do where the two differ only by a first token one side adds (BOS): which side adds it, and the
    setting that decides it. A SentencePiece checkpoint without tokenizer.json whose tokenizer_config.json
    says no ``add_bos_token`` gets no BOS from transformers 5, while llama.cpp adds one."""
    if report.position != 0:
        return None
    hf, gguf = report.hf, report.gguf
    if report.n_gguf == report.n_hf + 1 and gguf[1:] == hf[:len(gguf) - 1]:
        adds, lacks, piece = "llama.cpp", "the HF tokenizer", report.gguf_pieces[0]
    elif report.n_hf == report.n_gguf + 1 and hf[1:] == gguf[:len(hf) - 1]:
        adds, lacks, piece = "the HF tokenizer", "llama.cpp", report.hf_pieces[0]
    else:
        return None
    return (f"only the first token differs: {adds} adds {piece!r} at the start and {lacks} does not; set "
            "add_bos_token in the checkpoint's tokenizer_config.json to what the model was trained with (it decides "
            "both sides: the GGUF's tokenizer.ggml.add_bos_token is written from it), then convert again, or pass "
            "--allow-tokenizer-mismatch to register it anyway (recorded in the lineage)")


def check_parity(gguf: Path, checkpoint: Path, *, python: str, env: dict[str, str], log_dir: Path,
                 timeout_s: float, allow: bool, texts: Mapping[str, str] | None = None,
                 keep: Path | None = None) -> dict[str, Any]:
    """Compare the GGUF's tokenization with the HF tokenizer's on the probe and on every one of ``texts``
    (label → text: the evaluation and calibration texts a run uses); return the lineage record.

    The probe covers what pre-tokenizers disagree on; the texts are what the variant is measured and
    calibrated on, where a rare disagreement (a digit run after a newline) can hide from any probe.

    Raises:
        TokenizerMismatchError: they differ and ``allow`` is off (the message shows the first position,
            the text it is in and the characters around it).
        ConversionError: llama.cpp cannot load the GGUF's vocabulary.
    """
    samples = {PROBE: PROBE_TEXT, **(texts or {})}
    # llama.cpp's side in its worker process while the HF side tokenizes here (about 1.1 s and 0.8 s on the
    # real checkpoint's texts, 2 cores: the thread only waits on the worker)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gguf-tokenize") as pool:
        worker = pool.submit(gguf_tokenize, gguf, samples, python=python, env=env, log_dir=log_dir,
                             timeout_s=timeout_s, keep=keep)
        hf = {label: _hf_encode(checkpoint, text) for label, text in samples.items()}
        engine = worker.result()
    reports = []
    for label, text in samples.items():
        ids, pieces, starts = hf[label]
        reports.append(compare((list(ids), list(pieces)), engine[label], label=label, text=text, starts=starts))
    bad = next((r for r in reports if not r.ok), None)
    if bad is not None and not allow:
        raise mismatch_error(bad, gguf, checkpoint)
    probe = reports[0]
    record: dict[str, Any] = {"ok": bad is None, "probe_sha256": probe.sha256, "tokens_hf": probe.n_hf,
                              "tokens_gguf": probe.n_gguf, "texts": {r.label: r.record() for r in reports}}
    if bad is not None:
        record.update({"first_difference": bad.position, "in": bad.label, "allowed_by_override": allow,
                       "hf": bad.hf, "gguf": bad.gguf})
    return record


# -- recorded results ---------------------------------------------------------------------------------


def checkpoint_tokenizer_sha256(checkpoint: Path) -> str:
    """sha256 over the names and bytes of the checkpoint's tokenizer files (those of TOKENIZER_FILES it has)."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = checkpoint / name
        if path.is_file():
            digest.update(json.dumps([name, path.stat().st_size]).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def parity_key(tokenizer_sha256: str, checkpoint: Path, texts: Mapping[str, str], *, allow: bool,
               engine: Mapping[str, Any]) -> str:
    """Key of a parity result: the GGUF's tokenizer metadata digest, the HF tokenizer files, the probe, each
    text (label and sha256), the override flag, what else the GGUF side depends on (``engine``: llama.cpp's
    identity, the GGUF's architecture) and the versions of transformers and tokenizers (the HF side)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    parts = {"tokenizer_sha256": tokenizer_sha256, "checkpoint_tokenizer": checkpoint_tokenizer_sha256(checkpoint),
             "probe": probe_sha256(), "texts": sorted((label, probe_sha256(t)) for label, t in texts.items()),
             "allow": allow, "engine": dict(engine), "hf": [installed("transformers"), installed("tokenizers")]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def recorded_parity(folder: Path, key: str) -> dict[str, Any] | None:
    """The agreement recorded under ``key`` in ``folder`` (``record``, ``checked_on``), None when there is none
    (or it is unreadable, or not an agreement)."""
    try:
        entry = json.loads((folder / f"{key}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(entry, dict) and entry.get("key") == key and isinstance(entry.get("record"), dict)
    return entry if ok and entry["record"].get("ok") is True else None


def record_parity(folder: Path, key: str, record: Mapping[str, Any], checked_on: str) -> None:
    """Record an agreement (``record["ok"]``) under ``key``; a mismatch is never recorded."""
    if record.get("ok") is not True:
        return
    entry = {"key": key, "checked_on": checked_on, "record": dict(record)}
    write_atomic(folder / f"{key}.json", json.dumps(entry, sort_keys=True))
