"""Tokenizer parity: does the GGUF tokenize like the checkpoint's own Hugging Face tokenizer?

A GGUF carries its own copy of the vocabulary and a pre-tokenizer *name*; when the converter guesses
that name wrong, llama.cpp silently splits text differently from the model's training tokenizer and
quality drops without any error. So every built GGUF tokenizes a probe text (whitespace runs, digits,
contractions, code, several scripts, emoji) with llama.cpp — in a worker subprocess, as the
orchestrating process never imports an engine — and the ids are compared with ``AutoTokenizer``'s.
"""

from __future__ import annotations

import functools
import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConversionError, TokenizerMismatchError
from pipeline.proc import run_logged

WORKER = "converters.workers.gguf_tokenize"
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


@dataclass(frozen=True)
class ParityReport:
    """What the parity check found; ``record()`` is what lineage keeps."""

    ok: bool
    n_hf: int
    n_gguf: int
    position: int | None
    hf: list[int]
    gguf: list[int]
    hf_pieces: list[str]
    gguf_pieces: list[str]

    def record(self, allowed: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.ok, "probe_sha256": probe_sha256(), "tokens_hf": self.n_hf,
                               "tokens_gguf": self.n_gguf}
        if not self.ok:
            out.update({"first_difference": self.position, "allowed_by_override": allowed,
                        "hf": self.hf, "gguf": self.gguf})
        return out


def probe_sha256(text: str = PROBE_TEXT) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@functools.lru_cache(maxsize=8)
def hf_tokens(checkpoint: Path, text: str = PROBE_TEXT) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Ids and pieces of ``text`` with the checkpoint's own tokenizer, special tokens added as by default."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    ids = list(tok(text)["input_ids"])
    return tuple(ids), tuple(str(p) for p in tok.convert_ids_to_tokens(ids))


def gguf_tokens(gguf: Path, *, python: str, env: dict[str, str], log_dir: Path, timeout_s: float,
                text: str = PROBE_TEXT) -> tuple[list[int], list[str]]:
    """Ids and pieces of ``text`` with the GGUF's tokenizer, from a llama.cpp worker subprocess."""
    with tempfile.TemporaryDirectory(dir=log_dir) as tmp:
        output = Path(tmp) / "tokens.json"
        request = {"model": str(gguf), "text": text, "output": str(output)}
        res = run_logged([python, "-m", WORKER], log_dir=log_dir, name=f"tokenize-{gguf.stem}", timeout_s=timeout_s,
                         env=env, stdin_text=json.dumps(request))
        if not res.ok or not output.is_file():
            raise ConversionError(f"llama.cpp could not load the tokenizer of {gguf.name}: the worker {res.describe()}",
                                  stderr_tail=res.stderr_tail, hint=f"see the log {res.log}")
        data = json.loads(output.read_text(encoding="utf-8"))
    return [int(i) for i in data["ids"]], [str(p) for p in data["pieces"]]


def compare(hf: tuple[list[int], list[str]], gguf: tuple[list[int], list[str]]) -> ParityReport:
    """Find the first position where the two tokenizations differ (or where one ends early)."""
    (hf_ids, hf_pieces), (gg_ids, gg_pieces) = hf, gguf
    position = next((i for i, (a, b) in enumerate(zip(hf_ids, gg_ids, strict=False)) if a != b), None)
    if position is None and len(hf_ids) != len(gg_ids):
        position = min(len(hf_ids), len(gg_ids))
    lo, hi = (0, 0) if position is None else (max(0, position - CONTEXT), position + CONTEXT + 1)
    return ParityReport(ok=position is None, n_hf=len(hf_ids), n_gguf=len(gg_ids), position=position,
                        hf=hf_ids[lo:hi], gguf=gg_ids[lo:hi], hf_pieces=hf_pieces[lo:hi], gguf_pieces=gg_pieces[lo:hi])


def mismatch_error(report: ParityReport, gguf: Path, checkpoint: Path) -> TokenizerMismatchError:
    assert report.position is not None
    start = max(0, report.position - CONTEXT)
    return TokenizerMismatchError(
        f"{gguf.name} tokenizes differently from the HF tokenizer of {checkpoint}: first difference at token "
        f"position {report.position} of the probe text ({report.n_hf} HF tokens, {report.n_gguf} GGUF tokens). "
        f"From position {start}: HF {report.hf} {report.hf_pieces} vs GGUF {report.gguf} {report.gguf_pieces}",
        position=report.position, expected=report.hf, found=report.gguf,
        hint="the GGUF would silently feed the model different tokens than it was trained on; fix the tokenizer "
             "files or llama.cpp's pre-tokenizer detection, or pass --allow-tokenizer-mismatch to register it "
             "anyway (recorded in the lineage)")


def check_parity(gguf: Path, checkpoint: Path, *, python: str, env: dict[str, str], log_dir: Path,
                 timeout_s: float, allow: bool) -> dict[str, Any]:
    """Compare the GGUF's tokenization of the probe with the HF tokenizer's; return the lineage record.

    Raises:
        TokenizerMismatchError: they differ and ``allow`` is off (the message shows the first position).
        ConversionError: llama.cpp cannot load the GGUF's vocabulary.
    """
    hf_ids, hf_pieces = hf_tokens(checkpoint)
    report = compare((list(hf_ids), list(hf_pieces)),
                     gguf_tokens(gguf, python=python, env=env, log_dir=log_dir, timeout_s=timeout_s))
    if not report.ok and not allow:
        raise mismatch_error(report, gguf, checkpoint)
    return report.record(allowed=allow)
