"""The documentation's generated parts, and the check that keeps README.md and docs/ true to the files and the code.

One rule: a figure about this project's own measurements is rendered from a file in ``bench/results/``, and a limit
or a default from the code; none is typed by hand. Two mechanisms carry it:

* **Blocks.** In README.md and docs/**/*.md, ``<!-- render:NAME -->`` … ``<!-- /render -->`` holds the fragment NAME
  (:data:`FRAGMENTS`; ``file:RESULT`` and ``section:RESULT:HEADING`` take a result file whole or one section of
  it). ``render`` rewrites every block; ``check`` fails where a block differs from what the files and the code give
  now, or names a fragment or a file that does not exist.
* **Generated pages.** docs/cli.md is the Typer app's every command and option (:func:`cli_page`); ``check`` fails
  when it differs from what the app gives.

``check`` also fails on a figure outside a block that looks like a measurement (a number with a unit of time,
size, speed or a ratio: :data:`MEASURED`), outside code: such a figure has no file behind it. A line that must
state one anyway (a unit's definition) carries ``<!-- not-measured -->``.

Usage: python scripts/docs.py render | check [--root DIR]   (make docs runs check, then mkdocs build --strict)
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BLOCK = re.compile(r"(<!-- render:(?P<name>[^\n]+?) -->)(?P<nl>\n?)(?P<body>.*?)(<!-- /render -->)", re.S)
INLINE = re.compile(r"<!-- render:[^\n]+? -->[^\n]*?<!-- /render -->")
#: A measurement-looking figure: a number with a unit of time, size, speed, or a ratio/percentage.
MEASURED = re.compile(r"(?<![\w.\-/])\d[\d,]*(?:\.\d+)?\s?(?:ms|s|min|h|%|×|GB|GiB|MB|MiB|tok/s)(?![\w/])"
                      r"|(?<![\w.])\d\.\d+e-\d+")
#: Code the current results must have been measured with (a result file's commit counts as "the current code"
#: when none of these changed since).
CODE = ("pipeline", "flows", "converters", "evaluators", "registry")
GENERATED_PAGES = ("cli.md",)


# --- result files -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResultFile:
    """A file in bench/results/: its header's facts (``# command:``, ``# commit:``, ``# CPU:``, ``# date:``)."""

    path: Path
    command: str
    commit: str
    cpu: str
    date: str
    dirty: bool = False  # measured with uncommitted changes to the code: not any commit's code

    @classmethod
    def read(cls, path: Path) -> ResultFile:
        head = {}
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines()[:12]:
            m = re.match(r"# (command|commit|CPU|date): (.*)", line)
            if m:
                head[m.group(1)] = m.group(2).strip()
        commit = head.get("commit", "")
        return cls(path, head.get("command", ""), commit.split()[0] if commit else "", head.get("CPU", ""),
                   head.get("date", ""), "uncommitted" in commit)

    @property
    def machine(self) -> str:
        """The machine kind: the CPU model and its ISA flags (what decides the kernels)."""
        m = re.match(r"(.*?), \d+ cores, ISA flags: ([^;]*)", self.cpu)
        return f"{m.group(1)} ({m.group(2).strip()})" if m else self.cpu


def current(commit: str, root: Path) -> bool:
    """Whether the code measured at ``commit`` is the code at HEAD (:data:`CODE` unchanged since)."""
    if not commit:
        return False
    done = subprocess.run(["git", "diff", "--quiet", commit, "HEAD", "--", *CODE], cwd=root, capture_output=True)
    return done.returncode == 0


def results(root: Path, glob: str) -> list[ResultFile]:
    return sorted((ResultFile.read(p) for p in (root / "bench" / "results").glob(glob)), key=lambda r: r.path.name)


# --- fragments ----------------------------------------------------------------------------------------------------


def policy_limits(root: Path) -> str:
    """The default quality limits, from pipeline/policy.py itself."""
    from pipeline.policy import DEFAULT_CLASSES, DEFAULT_TYPES, MARGIN

    def row(name: str, lim: object) -> str:
        kld = getattr(lim, "max_kld", None)
        dppl = getattr(lim, "max_delta_ppl_pct", None)
        top1 = getattr(lim, "min_top1", None)
        return (f"| {name} | {'—' if kld is None else f'{kld:g}'} | {'—' if dppl is None else f'{dppl:g}'} "
                f"| {'—' if top1 is None else f'{100 * top1:g}'} |")

    out = [f"Each limit is {MARGIN:g} × llama.cpp's published LLaMA 3 8B figure (`pipeline/policy.py`).", "",
           "| class | max KLD | max ΔPPL % | min top-1 % |", "|---|---:|---:|---:|"]
    out += [row(c, lim) for c, lim in DEFAULT_CLASSES.items()]
    out += ["", "| GGUF type | max KLD | max ΔPPL % | min top-1 % |", "|---|---:|---:|---:|"]
    out += [row(t, lim) for t, lim in DEFAULT_TYPES.items()]
    return "\n".join(out)


def gpu_status(root: Path) -> str:
    from pipeline.status import markdown_table

    return markdown_table()


def settings_table(root: Path) -> str:
    """Every setting: its environment variable, default and description (pipeline/config.py)."""
    from pydantic import AliasChoices

    from pipeline.config import Settings

    out = ["| variable | default | what |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.default
        computed = field.default_factory is not None or (isinstance(default, str) and default.startswith("/"))
        shown = "(computed on this machine)" if computed else repr(default)
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        alias = field.validation_alias
        names = [f"QUANTYARD_{name.upper()}"]
        if isinstance(alias, AliasChoices):  # read from the standard variable (HF_ENDPOINT…) instead
            names = sorted({str(c).upper() for c in alias.choices})
        variables = ", ".join(f"`{n}`" for n in names)
        out.append(f"| {variables} | `{shown}` | {desc} |")
    return "\n".join(out)


def _pairs(text: str) -> list[tuple[str, float, float]]:
    """(model, llama.cpp s, quantyard s) of every pair in a bench/pipeline_vs_llamacpp.py output."""
    out, model = [], ""
    for line in text.splitlines():
        if line.startswith("### ") and "repeats" not in line:
            model = line[4:].split(" (")[0].split(":")[0]
            if "synthetic" in line:  # a synthetic checkpoint's path, or a built-in size's heading (8b)
                model += " (SYNTHETIC)"
        m = re.match(r"\| \*\*whole command\*\* \| \*\*([\d.]+)\*\* \| \*\*([\d.]+) = ", line)
        if m:
            out.append((model, float(m.group(1)), float(m.group(2))))
    return out


def whole_job_current(root: Path) -> str:
    """:func:`whole_job`'s rows that have pairs at the current code (README.md; the site shows every row)."""
    return whole_job(root, current_only=True)


def whole_job(root: Path, current_only: bool = False) -> str:
    """The whole job against llama.cpp's own tools: per machine kind and model, the median ratio of every pair
    measured at the current code, with the count; where none is at the current code, the latest and its commit
    (``current_only``: those rows left out)."""
    groups: dict[tuple[str, str], list[tuple[float, ResultFile]]] = {}
    for f in results(root, "pipeline_vs_llamacpp*.txt"):
        for model, hand, qy in _pairs(f.path.read_text(encoding="utf-8")):
            name = Path(model).name if "/" in model else model
            groups.setdefault((f.machine, name), []).append((qy / hand, f))
    out = ["| machine (2 cores) | checkpoint | pairs at the current code | median ratio (Quantyard / llama.cpp) "
           "| files |",
           "|---|---|---:|---:|---|"]
    for (machine, model), runs in sorted(groups.items()):
        now = [(r, f) for r, f in runs if not f.dirty and current(f.commit, root)]
        if now:
            names = sorted({f.path.name for _, f in now})
            out.append(f"| {machine} | {model} | {len(now)} | **{statistics.median(r for r, _ in now):.3f}** "
                       f"| {', '.join(f'`{n}`' for n in names)} |")
        elif not current_only:
            last = max(runs, key=lambda x: x[1].date)
            out.append(f"| {machine} | {model} | 0 (latest at {last[1].commit or '?'}: {last[0]:.3f}) | — "
                       f"| `{last[1].path.name}` |")
    if current_only and len(out) == 2:
        out.append("| — | — | 0 | — | no pair at the current code yet |")
    return "\n".join(out)


def results_index(root: Path) -> str:
    """Every result file: what made it, at which commit, on which machine, when."""
    out = ["| file | command | commit | machine | date |", "|---|---|---|---|---|"]
    for f in results(root, "*"):
        out.append(f"| `{f.path.name}` | `{f.command[:90] or '(see the file)'}` | {f.commit or '—'} "
                   f"| {f.machine or '—'} | {f.date or '—'} |")
    return "\n".join(out)


def suite_runs(root: Path) -> str:
    """The whole-suite and demo runs kept in bench/results/ (make test, make demo), each with the first lines of its
    header, which say the machine: where the tests and the demo have run."""
    out = ["| file | what its header says |", "|---|---|"]
    for path in sorted((root / "bench" / "results").glob("*")):
        if not path.name.startswith(("make_test", "fresh_make_demo", "make_demo")):
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()[:3]
        head = [ln.lstrip("# ").strip() for ln in lines if ln.strip()]
        said = " ".join(head).replace("|", "/")
        out.append(f"| `{path.name}` | {said[:300]}{'…' if len(said) > 300 else ''} |")
    return "\n".join(out)


def result_file(root: Path, name: str, heading: str | None = None, until: str | None = None) -> str:
    """A result file (or one section of it: from the heading starting with ``heading`` to the next heading of its
    level or above, or to the first line starting with ``until``, a code block left open there closed), its
    header lines as a list, its headings demoted two levels under the page's."""
    path = root / "bench" / "results" / name
    if not path.is_file():
        raise FileNotFoundError(f"bench/results/{name} does not exist")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    head = [ln[2:] for ln in lines if ln.startswith("# ")][:6]
    body = [ln for ln in lines if not ln.startswith("# ")]
    if heading is not None:
        start = next((i for i, ln in enumerate(body) if ln.lstrip("#").strip().startswith(heading)
                      and ln.startswith("#")), None)
        if start is None:
            raise KeyError(f"bench/results/{name} has no heading starting with {heading!r}")
        level = len(body[start]) - len(body[start].lstrip("#"))
        end = next((j for j in range(start + 1, len(body)) if body[j].startswith("#")
                    and len(body[j]) - len(body[j].lstrip("#")) <= level), len(body))
        body = body[start:end]
    if until is not None:
        cut = next((i for i, ln in enumerate(body) if ln.strip().startswith(until)), None)
        if cut is None:
            raise KeyError(f"bench/results/{name} has no line starting with {until!r} in {heading!r}")
        body = body[:cut]
        if sum(ln.startswith("```") for ln in body) % 2:
            body.append("```")
    body = ["##" + ln if ln.startswith("#") else ln for ln in body]
    what = f"{heading}, up to “{until}”" if until else heading
    source = [f"*From `bench/results/{name}`*" + (f" ({what})" if what else "") + ":", ""]
    source += [f"- {h}" for h in head] + ([""] if head else [])
    return "\n".join(source + body).strip()


def code_value(root: Path, name: str) -> str:
    """A limit or default from the code, by dotted name (``pipeline.footprint.COMFORT``); ``NAME:%`` shows a
    fraction as a percentage (0.8 → 80%)."""
    from importlib import import_module

    name, _, fmt = name.partition(":")
    module, _, attr = name.rpartition(".")
    value = getattr(import_module(module), attr)
    if fmt == "%":
        return f"{100 * float(value):g}%"
    return str(value)


FRAGMENTS: dict[str, Callable[[Path], str]] = {
    "policy-limits": policy_limits,
    "gpu-status": gpu_status,
    "settings": settings_table,
    "whole-job": whole_job,
    "whole-job-current": whole_job_current,
    "results-index": results_index,
    "suite-runs": suite_runs,
}


def fragment(name: str, root: Path) -> str:
    """The text of fragment ``name``: one of :data:`FRAGMENTS`, ``file:RESULT``, ``section:RESULT:HEADING``
    (``section:RESULT:HEADING|UNTIL``: up to the first line starting with UNTIL) or ``code:module.NAME``.
    Raises KeyError / FileNotFoundError naming what is missing."""
    if name.startswith("file:"):
        return result_file(root, name[5:])
    if name.startswith("section:"):
        _, result, heading = name.split(":", 2)
        heading, _, until = heading.partition("|")
        return result_file(root, result, heading, until or None)
    if name.startswith("code:"):
        return code_value(root, name[5:])
    if name not in FRAGMENTS:
        raise KeyError(f"no fragment {name!r}; known: {', '.join(sorted(FRAGMENTS))}, file:…, section:…, code:…")
    return FRAGMENTS[name](root)


# --- the CLI page -------------------------------------------------------------------------------------------------


def cli_page() -> str:
    """Every command and option of the Typer app, with its help, as Markdown (docs/cli.md)."""
    import typer

    from pipeline.cli import app

    root = typer.main.get_command(app)
    out = ["# Command reference", "",
           "Generated from the command-line app itself (`python scripts/docs.py render`); `make docs` fails when "
           "it differs from the app. Every command also takes `--help`.", ""]

    def walk(cmd: Any, path: list[str]) -> None:
        commands = getattr(cmd, "commands", None)
        if commands is not None:  # a group (typer vendors its own click: duck-typed)
            for name in sorted(commands):
                walk(commands[name], [*path, name])
            return
        out.extend([f"## `{' '.join(path)}`", "", _help(cmd.help), ""])
        rows = []
        for p in cmd.params:
            if p.param_type_name == "argument":
                rows.append(f"| `{(p.name or '?').upper()}` | argument | {_help(getattr(p, 'help', ''))} |")
            elif p.param_type_name == "option" and p.name != "help":
                flag_off = p.is_flag and p.default is False
                default = "" if p.default is None or flag_off else f" (default: `{p.default}`)"
                names = ", ".join(f"`{o}`" for o in (*p.opts, *p.secondary_opts))
                rows.append(f"| {names} | option | {_help(p.help)}{default} |")
        if rows:
            out.extend(["| name | kind | what |", "|---|---|---|", *rows, ""])

    walk(root, ["quantyard"])
    return "\n".join(out).rstrip() + "\n"


def _help(text: str | None) -> str:
    return " ".join((text or "").replace("\b", "").split()).replace("|", "/")


# --- render and check ---------------------------------------------------------------------------------------------


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def rendered(text: str, root: Path) -> str:
    """``text`` with every block holding its fragment: a block that opens on a line of its own holds it as lines,
    an inline one (``<!-- render:code:… -->80 %<!-- /render -->``) as one line of text."""
    def one(m: re.Match[str]) -> str:
        body = fragment(m.group("name"), root).rstrip()
        if m.group("nl"):
            return f"{m.group(1)}\n{body}\n{m.group(5)}"
        return m.group(1) + " ".join(body.split()) + m.group(5)

    return BLOCK.sub(one, text)


def render(root: Path) -> list[Path]:
    """Rewrite every block and the generated pages; returns the files changed. A page with a block whose source is
    missing is left as it is and named on stderr (``check`` fails on it)."""
    changed = []
    for page in pages(root):
        if page.name in GENERATED_PAGES and page.parent.name == "docs":
            continue
        text = page.read_text(encoding="utf-8")
        try:
            new = rendered(text, root)
        except (KeyError, FileNotFoundError) as exc:
            print(f"{page.relative_to(root)}: not rendered: {exc}", file=sys.stderr)
            continue
        if new != text:
            page.write_text(new, encoding="utf-8")
            changed.append(page)
    cli = root / "docs" / "cli.md"
    if not cli.is_file() or cli.read_text(encoding="utf-8") != cli_page():
        cli.write_text(cli_page(), encoding="utf-8")
        changed.append(cli)
    return changed


def _outside(text: str) -> list[tuple[int, str]]:
    """Lines of prose: outside render blocks, code fences and inline code, with their line numbers."""
    out, fenced, in_block = [], False, False
    for no, line in enumerate(text.splitlines(), 1):
        line = INLINE.sub("", line)
        if line.startswith("<!-- render:"):
            in_block = True
        elif line.startswith("<!-- /render -->"):
            in_block = False
            continue
        if in_block:
            continue
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or "<!-- not-measured -->" in line:
            continue
        out.append((no, re.sub(r"`[^`]*`|\]\([^)]*\)|<!--.*?-->", "", line)))
    return out


def problems(root: Path) -> list[str]:
    """What ``check`` fails on (module docstring), one line each."""
    out = []
    for page in pages(root):
        rel = page.relative_to(root)
        text = page.read_text(encoding="utf-8")
        if page.name in GENERATED_PAGES and page.parent.name == "docs":
            if text != cli_page():
                out.append(f"{rel}: differs from the command-line app (run python scripts/docs.py render)")
            continue
        try:
            if rendered(text, root) != text:
                out.append(f"{rel}: a rendered block differs from its source (run python scripts/docs.py render)")
        except (KeyError, FileNotFoundError) as exc:
            out.append(f"{rel}: {exc}")
        for no, line in _outside(text):
            for m in MEASURED.finditer(line):
                out.append(f"{rel}:{no}: figure {m.group(0)!r} has no source: render it from a file in "
                           "bench/results/ or from the code (<!-- render:… -->), or mark a definition "
                           "<!-- not-measured -->")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("render", "check"))
    ap.add_argument("--root", type=Path, default=ROOT)
    args = ap.parse_args()
    if args.what == "render":
        for path in render(args.root):
            print(f"rendered {path.relative_to(args.root)}")
        return
    found = problems(args.root)
    for line in found:
        print(line, file=sys.stderr)
    if found:
        raise SystemExit(f"docs check: {len(found)} problem(s)")
    print("docs check: every rendered block and generated page matches its source; no unsourced figure")


if __name__ == "__main__":
    main()
