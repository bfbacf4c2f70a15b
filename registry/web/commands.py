"""Copy-paste commands for a version: pull it out of the registry, fetch it over HTTP, serve it on its engine.

The launch command follows each engine's own convention: the format's ``launcher`` in
:data:`pipeline.formats.FORMATS`. Every value interpolated here is a registry name (letters, digits, ``._-/@``) or a
registered file name, quoted for the shell with :func:`shlex.quote`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from urllib.parse import quote

from pipeline.formats import FORMATS
from registry.views import FileView, VersionView


@dataclass(frozen=True)
class Command:
    label: str
    text: str


def _dest(view: VersionView) -> str:
    return f"{view.model.replace('/', '--')}-{view.variant}"


def launch_command(view: VersionView, dest: str) -> Command | None:
    """The engine's launch command for a copy of ``view`` pulled into ``dest`` (FormatInfo.launcher); None
    when the format has none, is not known to this installation, or lacks the file its launcher needs."""
    info = FORMATS.get(view.format)  # type: ignore[call-overload]  # a QuantFormat is its str value
    launcher = None if info is None else info.launcher
    if launcher is None:
        return None
    first = sorted(f.name for f in view.files if launcher.suffix is None or f.name.endswith(launcher.suffix))
    if not first:
        return None
    values = {"dest": dest, "variant": view.variant, "first_file": first[0], "path": f"{dest}/{first[0]}"}
    return Command(launcher.label, launcher.template.format(**{k: shlex.quote(v) for k, v in values.items()}))


def download_path(ref: str, name: str) -> str:
    """The API path of one file of a version (``name`` percent-encoded, ``/`` kept)."""
    return f"/api/v1/versions/{quote(ref, safe='/@')}/-/files/{quote(name, safe='/')}"


def commands(view: VersionView, base_url: str) -> list[Command]:
    """Pull, HTTP download with a checksum check, and the engine's launch command."""
    dest = _dest(view)
    out = [Command("Quantyard (sha256 verified)", f"quantyard pull {shlex.quote(view.ref)} {shlex.quote(dest)}")]
    out.append(Command("curl + sha256sum", _curl(view.files, view.ref, base_url, dest)))
    launch = launch_command(view, dest)
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
