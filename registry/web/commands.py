"""Copy-paste commands for a version: pull it out of the registry, fetch it over HTTP, serve it on its engine.

The launch command follows each engine's own convention; add a format by adding an entry to
:data:`LAUNCHERS`. Every value interpolated here is a registry name (letters, digits, ``._-/@``) or a
registered file name, quoted for the shell with :func:`shlex.quote`.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

from registry.views import FileView, VersionView


@dataclass(frozen=True)
class Command:
    label: str
    text: str


def _dest(view: VersionView) -> str:
    return f"{view.model.replace('/', '--')}-{view.variant}"


def _gguf(view: VersionView, dest: str) -> Command | None:
    ggufs = sorted(f.name for f in view.files if f.name.endswith(".gguf"))
    if not ggufs:
        return None
    # A split GGUF is loaded through its first part; llama.cpp finds the others beside it.
    return Command("llama.cpp server", f"llama-server -m {shlex.quote(f'{dest}/{ggufs[0]}')} --port 8080")


def _awq(view: VersionView, dest: str) -> Command:
    return Command("vLLM", f"vllm serve {shlex.quote(dest)} --served-model-name {shlex.quote(view.variant)}")


def _exl2(view: VersionView, dest: str) -> Command:
    return Command("TabbyAPI (ExLlamaV2), from its checkout",
                   f"python main.py --model-dir . --model-name {shlex.quote(dest)}")


#: format -> the engine launch command for a pulled copy in folder ``dest``.
LAUNCHERS: dict[str, Callable[[VersionView, str], Command | None]] = {"gguf": _gguf, "awq": _awq, "exl2": _exl2}


def download_path(ref: str, name: str) -> str:
    """The API path of one file of a version (``name`` percent-encoded, ``/`` kept)."""
    return f"/api/v1/versions/{quote(ref, safe='/@')}/-/files/{quote(name, safe='/')}"


def commands(view: VersionView, base_url: str) -> list[Command]:
    """Pull, HTTP download with a checksum check, and the engine's launch command."""
    dest = _dest(view)
    out = [Command("Quantyard (sha256 verified)", f"quantyard pull {shlex.quote(view.ref)} {shlex.quote(dest)}")]
    out.append(Command("curl + sha256sum", _curl(view.files, view.ref, base_url, dest)))
    launcher = LAUNCHERS.get(view.format)
    launch = launcher(view, dest) if launcher is not None else None
    if launch is not None:
        out.append(launch)
    return out


def _curl(files: list[FileView], ref: str, base_url: str, dest: str) -> str:
    lines = [f"mkdir -p {shlex.quote(dest)} && cd {shlex.quote(dest)}"]
    for f in files:
        url = base_url.rstrip("/") + download_path(ref, f.name)
        lines.append(f"curl -fL --create-dirs -o {shlex.quote(f.name)} {shlex.quote(url)}")
    lines.append("sha256sum -c <<'EOF'\n" + "\n".join(f"{f.sha256}  {f.name}" for f in files) + "\nEOF")
    return "\n".join(lines)
