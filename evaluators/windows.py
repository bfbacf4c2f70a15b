"""Window sets: the exact token ids every engine is scored on.

The evaluation text is tokenized once, with the source's own HF tokenizer, and
cut into windows of ``window`` ids. Window ``k`` holds the text tokens starting at
``k * stride`` (after a BOS when the tokenizer adds one). Inside a window, the
target at index ``i`` is predicted from indices ``< i``; ``score_start[k]`` is the
first target index scored, chosen so that with overlapping windows every text
token is scored exactly once, always with the most context available. A partial
last window is dropped.

``score_from`` raises the first scored target index of every window: targets before it are
context only. ``score_from = window // 2 + 1`` with ``stride = window`` scores exactly the
positions ``llama-perplexity`` scores (the second half of each chunk: every target then has at
least half a window of context); the default, 1, scores every target.

The id of a window set is the sha256 of (ids, window, stride, score_start); the
file is stored as a registry artifact of the source and reused by every engine.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import InvalidSpecError
from pipeline.plan import check_score_from


@dataclass(frozen=True)
class WindowSet:
    ids: np.ndarray  # int32 [n_windows, window]
    score_start: np.ndarray  # int32 [n_windows]
    window: int
    stride: int
    add_bos: bool
    text_sha256: str

    @property
    def id(self) -> str:
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.ids, dtype="<i4").tobytes())
        h.update(f"|window={self.window}|stride={self.stride}|".encode())
        h.update(np.ascontiguousarray(self.score_start, dtype="<i4").tobytes())
        return h.hexdigest()

    @property
    def n_windows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def n_scored(self) -> int:
        return int(sum(self.window - int(s) for s in self.score_start))

    def scored_targets(self) -> np.ndarray:
        """The target token ids in scoring order (window-major), shape [n_scored]."""
        return np.concatenate([self.ids[k, int(s):] for k, s in enumerate(self.score_start)])

    def meta(self) -> dict[str, object]:
        return {"id": self.id, "window": self.window, "stride": self.stride, "add_bos": self.add_bos,
                "n_windows": self.n_windows, "n_scored": self.n_scored, "score_from": int(self.score_start.min()),
                "text_sha256": self.text_sha256}

    def save(self, path: Path) -> None:
        buf = io.BytesIO()
        np.savez(buf, ids=self.ids.astype(np.int32), score_start=self.score_start.astype(np.int32),
                 window=np.int64(self.window), stride=np.int64(self.stride), add_bos=np.bool_(self.add_bos),
                 text_sha256=np.array(self.text_sha256))
        path.write_bytes(buf.getvalue())

    @classmethod
    def load(cls, path: Path) -> WindowSet:
        with np.load(path, allow_pickle=False) as z:
            return cls(ids=z["ids"], score_start=z["score_start"], window=int(z["window"]),
                       stride=int(z["stride"]), add_bos=bool(z["add_bos"]), text_sha256=str(z["text_sha256"]))


def cut_windows(tokens: list[int], *, window: int, stride: int, bos_id: int | None,
                max_windows: int | None = None, text_sha256: str = "", score_from: int = 1) -> WindowSet:
    """Cut ``tokens`` (text token ids, no specials) into a :class:`WindowSet`."""
    if window < 2 or stride < 1:
        raise InvalidSpecError(f"window must be >= 2 and stride >= 1, got window={window}, stride={stride}")
    check_score_from(window, score_from)
    bos = 1 if bos_id is not None else 0
    n_text = window - bos
    rows, starts = [], []
    k = 0
    while k * stride + n_text <= len(tokens):
        s = k * stride
        chunk = tokens[s:s + n_text]
        rows.append(([bos_id] if bos_id is not None else []) + chunk)
        if k == 0:
            first = 1
        else:
            prev_end = (k - 1) * stride + n_text  # first text position not scored yet
            first = max(1, prev_end - s + bos)
        starts.append(max(first, score_from))
        k += 1
        if max_windows is not None and k >= max_windows:
            break
    if not rows:
        raise InvalidSpecError(
            f"the evaluation text has {len(tokens)} tokens, fewer than one window of {window}",
            hint="use a longer --eval-text or a smaller --window")
    return WindowSet(ids=np.asarray(rows, dtype=np.int32), score_start=np.asarray(starts, dtype=np.int32),
                     window=window, stride=stride, add_bos=bos_id is not None, text_sha256=text_sha256)


def build_window_set(tokenizer_dir: Path, text: str, *, window: int = 512, stride: int = 512,
                     max_windows: int | None = None, add_bos: bool | None = None, score_from: int = 1) -> WindowSet:
    """Tokenize ``text`` with the source's HF tokenizer and cut it into windows.

    ``add_bos`` defaults to what the tokenizer does for a plain encode.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    tokens = tok(text, add_special_tokens=False)["input_ids"]
    if add_bos is None:
        probe = tok("a", add_special_tokens=True)["input_ids"]
        add_bos = tok.bos_token_id is not None and bool(probe) and probe[0] == tok.bos_token_id
    bos_id = tok.bos_token_id if add_bos else None
    return cut_windows(tokens, window=window, stride=stride, bos_id=bos_id, max_windows=max_windows,
                       text_sha256=hashlib.sha256(text.encode()).hexdigest(), score_from=score_from)
