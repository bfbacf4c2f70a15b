"""Resolve what the user typed (a folder, or a hub id plus revision) into a pinned :class:`SourceRef`.

A hub source is pinned in two steps: the revision (branch, tag or commit) is resolved to a commit SHA
with one model-info call, then exactly the files a conversion needs are fetched at that SHA with
``huggingface_hub.snapshot_download`` into the standard HF cache. Files already in the cache for that
SHA are not downloaded again. Without the hub (``HF_HUB_OFFLINE=1`` or no connection) an already
cached snapshot of the revision is used as it is.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converters.checkpoint import HashCache, content_hash
from pipeline.errors import SourceAccessError, SourceNotFoundError, UnsafeSourceError
from pipeline.specs import SourceKind, SourceRef

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
#: Non-weight files a conversion reads (config, tokenizer, generation config, model card, licence).
META_PATTERNS = ("*.json", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.md", "LICENSE*",
                 "calibration.txt", "eval.txt")
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"


@dataclass(frozen=True)
class HubOptions:
    """How to reach the Hub. ``None`` fields fall back to huggingface_hub's own defaults; the token
    comes from the standard HF configuration (``HF_TOKEN`` or ``hf auth login``) unless given."""

    endpoint: str | None = None
    cache_dir: Path | None = None
    offline: bool = False
    token: str | None = None


def looks_like_hub_id(text: str) -> bool:
    return bool(HUB_ID.match(text)) and not Path(text).exists()


def resolve_source(text: str, *, revision: str | None = None, cache_dir: Path, allow_pickle: bool = False,
                   hub: HubOptions | None = None) -> SourceRef:
    """Pin a source: hash a local folder, or resolve a hub revision to a commit and download it.

    Raises:
        SourceNotFoundError: the folder does not exist, or the hub repo / revision is unknown or not cached.
        SourceAccessError: the hub repo is gated or private and the token does not grant access.
        UnsafeSourceError: the hub repo has only pickle weights and ``allow_pickle`` is off.
    """
    path = Path(text).expanduser()
    if path.exists() or not looks_like_hub_id(text):
        if not path.exists():
            raise SourceNotFoundError(f"source {text} does not exist",
                                      hint="pass an existing checkpoint folder or a hub id owner/name")
        digest = content_hash(path, HashCache(cache_dir / "hashes.sqlite"))
        return SourceRef(kind=SourceKind.LOCAL, path=str(path.resolve()), content_hash=digest)
    return resolve_hub(text, revision, allow_pickle=allow_pickle, hub=hub or HubOptions())


def resolve_hub(repo_id: str, revision: str | None, *, allow_pickle: bool, hub: HubOptions) -> SourceRef:
    """Resolve ``revision`` of ``repo_id`` to a commit and fetch the files a conversion needs."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    rev = revision or "main"
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    with hub_errors(repo_id, rev):
        # one model-info call (none for a commit SHA); the revision -> SHA mapping is cached in refs/
        commit = api.resolve_revision(repo_id, revision=rev, cache_dir=hub.cache_dir,
                                      local_files_only=hub.offline).resolved

        def read_index(name: str) -> dict[str, object]:
            local = hf_hub_download(repo_id, name, revision=commit, cache_dir=hub.cache_dir, endpoint=hub.endpoint,
                                    token=hub.token, local_files_only=hub.offline)
            return dict(json.loads(Path(local).read_text(encoding="utf-8")))

        files = select_files(repo_id, _listing(api, repo_id, commit, hub), allow_pickle=allow_pickle,
                             read_index=read_index)
        folder = Path(snapshot_download(repo_id, revision=commit, allow_patterns=files, cache_dir=hub.cache_dir,
                                        endpoint=hub.endpoint, token=hub.token, local_files_only=hub.offline))
    return SourceRef(kind=SourceKind.HUB, path=str(folder), repo_id=repo_id, revision=rev, commit=commit)


def _listing(api: Any, repo_id: str, commit: str, hub: HubOptions) -> list[str]:
    """File names of the repo at ``commit``: from the cached tree listing, else one tree call."""
    from huggingface_hub import RepoFile, get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return [f.path for f in get_cached_repo_tree(repo_id, revision=commit, cache_dir=hub.cache_dir)]
    except CachedRepoTreeNotFoundError:
        if hub.offline:
            raise SourceNotFoundError(f"{repo_id}@{commit[:12]} is not in the local HF cache (offline)",
                                      hint="download it once with the hub reachable (unset HF_HUB_OFFLINE)") from None
    return [f.path for f in api.list_repo_tree(repo_id, revision=commit) if isinstance(f, RepoFile)]


def select_files(repo_id: str, names: list[str], *, allow_pickle: bool,
                 read_index: Callable[[str], dict[str, object]]) -> list[str]:
    """The top-level files to download: metadata, tokenizer and exactly one set of weights
    (the shards an index names, else ``model.safetensors``, else every ``*.safetensors``).

    Raises:
        UnsafeSourceError: only pickle weights exist and ``allow_pickle`` is off.
        SourceNotFoundError: no weights at all.
    """
    top = [n for n in names if "/" not in n]
    meta = [n for n in top if any(fnmatch.fnmatch(n, p) for p in META_PATTERNS)]
    weights = _weights(top, SAFETENSORS_INDEX, "model.safetensors", ".safetensors", read_index)
    if not weights:
        pickles = _weights(top, PICKLE_INDEX, "pytorch_model.bin", ".bin", read_index)
        if pickles and not allow_pickle:
            raise UnsafeSourceError(
                f"{repo_id} has only pickle weights ({', '.join(pickles[:3])}); loading them can run arbitrary "
                "code", hint="use a repo or revision with safetensors, or pass --allow-pickle if you trust it")
        weights = pickles
    if not weights:
        raise SourceNotFoundError(f"{repo_id} has no model weights at this revision (files: {', '.join(top[:12])})",
                                  hint="check the repo id and --revision")
    return sorted({*meta, *weights})


def _weights(top: list[str], index: str, single: str, suffix: str,
             read_index: Callable[[str], dict[str, object]]) -> list[str]:
    if index in top:
        weight_map = read_index(index).get("weight_map") or {}
        return sorted({str(v) for v in dict(weight_map).values()} | {index})  # type: ignore[call-overload]
    if single in top:
        return [single]
    return [n for n in top if n.endswith(suffix)]


@contextlib.contextmanager
def hub_errors(repo_id: str, revision: str) -> Iterator[None]:
    """Turn huggingface_hub's errors into Quantyard's typed ones (what, found, what to do)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        RevisionResolutionError,
    )

    login = "log in with `hf auth login` or set HF_TOKEN"
    try:
        yield
    except GatedRepoError as exc:
        raise SourceAccessError(f"{repo_id} is gated: your token (if any) has not been granted access",
                                hint=f"accept the repo's conditions on the Hub, then {login}") from exc
    except RevisionNotFoundError as exc:
        raise SourceNotFoundError(f"revision {revision!r} of {repo_id} does not exist",
                                  hint="pass a branch, tag or commit that exists") from exc
    except RepositoryNotFoundError as exc:
        raise SourceNotFoundError(f"hub repository {repo_id} not found (or private and not accessible with your "
                                  "token)", hint=f"check the id; for private repos {login}") from exc
    except (LocalEntryNotFoundError, RevisionResolutionError) as exc:
        raise SourceNotFoundError(f"{repo_id}@{revision} is not (completely) in the local HF cache and the hub "
                                  "cannot be reached", hint="go online once, or unset HF_HUB_OFFLINE") from exc
    except HfHubHTTPError as exc:
        raise SourceNotFoundError(f"the hub refused {repo_id}@{revision}: {str(exc).splitlines()[0]}",
                                  hint="check HF_ENDPOINT, your token and the hub's status") from exc
