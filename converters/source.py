"""Resolve what the user typed (a folder, or a hub id plus revision) into a pinned :class:`SourceRef`."""

from __future__ import annotations

import re
from pathlib import Path

from converters.checkpoint import HashCache, content_hash
from pipeline.errors import SourceNotFoundError
from pipeline.specs import SourceKind, SourceRef

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "tokenizer.model", "*.tiktoken",
                  "merges.txt", "vocab.txt", "*.md", "LICENSE*"]


def looks_like_hub_id(text: str) -> bool:
    return bool(HUB_ID.match(text)) and not Path(text).exists()


def resolve_source(text: str, *, revision: str | None = None, cache_dir: Path,
                   allow_pickle: bool = False, token: str | None = None) -> SourceRef:
    """Pin a source: hash a local folder, or resolve a hub revision to a commit and download it.

    Raises:
        SourceNotFoundError: the folder does not exist, or the hub repo / revision is unknown.
    """
    path = Path(text).expanduser()
    if path.exists() or not looks_like_hub_id(text):
        if not path.exists():
            raise SourceNotFoundError(f"source {text} does not exist",
                                      hint="pass an existing checkpoint folder or a hub id owner/name")
        digest = content_hash(path, HashCache(cache_dir / "hashes.sqlite"))
        return SourceRef(kind=SourceKind.LOCAL, path=str(path.resolve()), content_hash=digest)
    return _resolve_hub(text, revision, allow_pickle, token)


def _resolve_hub(repo_id: str, revision: str | None, allow_pickle: bool, token: str | None) -> SourceRef:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    patterns = [*ALLOW_PATTERNS, *(["*.bin"] if allow_pickle else [])]
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, token=token))
    except RevisionNotFoundError as exc:
        raise SourceNotFoundError(f"revision {revision!r} of {repo_id} does not exist",
                                  hint="pass a branch, tag or commit that exists") from exc
    except RepositoryNotFoundError as exc:
        raise SourceNotFoundError(f"hub repository {repo_id} not found (or not accessible with your token)",
                                  hint="check the id; for gated/private repos run `hf auth login`") from exc
    except LocalEntryNotFoundError as exc:
        raise SourceNotFoundError(f"{repo_id}@{revision or 'main'} is not in the local HF cache and the hub "
                                  "cannot be reached", hint="go online once, or unset HF_HUB_OFFLINE") from exc
    commit = folder.name  # snapshot folders are named by commit sha
    return SourceRef(kind=SourceKind.HUB, path=str(folder), repo_id=repo_id, revision=revision or "main",
                     commit=commit)
