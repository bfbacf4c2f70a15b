"""The shape of the code: format knowledge in one table, no format branches elsewhere.

Run ``python -m tests.test_architecture [ROOT]`` to print the counts for any checkout (the closing notes'
before/after numbers come from it).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from pipeline.formats import FORMATS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "converters", "evaluators", "registry", "flows")
FORMAT_VALUES = frozenset(str(f) for f in FORMATS) | {"gguf", "awq", "exl2"}
#: Where a format may be named: the table, the spec models, and each format's own converter and evaluator
#: modules (a format's own package names itself).
OWNERS = ("pipeline/formats.py", "pipeline/specs.py",
          "pipeline/envs.py")  # ENVS is keyed by tool-environment names, two of which are also format names
_SUBJECTS = {"fmt", "format", "formats"}


def _subject(node: ast.AST) -> bool:
    """Is ``node`` something that holds a format: ``fmt``, ``x.format``, ``x.fmt``, ``str(x.format)``…"""
    if isinstance(node, ast.Call) and node.args:
        return _subject(node.args[0])
    if isinstance(node, ast.Attribute):
        return node.attr in _SUBJECTS or (node.attr == "value" and _subject(node.value))
    return isinstance(node, ast.Name) and node.id in _SUBJECTS


def _format_constants(node: ast.AST) -> bool:
    """A format value: ``"gguf"``, ``QuantFormat.GGUF``, or a tuple/list/set holding one."""
    if isinstance(node, ast.Constant):
        return node.value in FORMAT_VALUES
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "QuantFormat":
        return True
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_format_constants(e) for e in node.elts)
    return False


def scan(root: Path) -> dict[str, list[str]]:
    """``branches``: comparisons of a format-holding name with a format value (``if fmt == "gguf"``);
    ``tables``: dict literals keyed by two or more format values; each as ``path:line``."""
    out: dict[str, list[str]] = {"branches": [], "tables": []}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in OWNERS or "/workers/" in rel or rel.endswith("/runner.py"):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            nodes = sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0))
            for node in nodes:
                if isinstance(node, ast.Compare):
                    sides = [node.left, *node.comparators]
                    if any(_subject(s) for s in sides) and any(_format_constants(s) for s in sides):
                        out["branches"].append(f"{rel}:{node.lineno}")
                elif isinstance(node, ast.Dict):
                    keys = [k for k in node.keys if k is not None and _format_constants(k)]
                    if len(keys) >= 2:
                        out["tables"].append(f"{rel}:{node.lineno}")
    return out


def test_no_format_branch_or_table_outside_the_format_table() -> None:
    found = scan(ROOT)
    assert found == {"branches": [], "tables": []}, (
        "format knowledge outside pipeline/formats.py (put it in the format's FormatInfo line or its converter): "
        f"{found}")


def test_the_scanner_finds_what_it_looks_for(tmp_path: Path) -> None:
    pkg = tmp_path / "flows"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text('def f(fmt, view):\n    if fmt == "gguf" or view.format in ("awq", "exl2"):\n'
                              '        return {"gguf": 1, QuantFormat.AWQ: 2}\n'
                              '    return spec.format.value != QuantFormat.EXL2\n')
    found = scan(tmp_path)
    assert sorted(found["branches"]) == ["flows/x.py:2", "flows/x.py:2", "flows/x.py:4"]
    assert found["tables"] == ["flows/x.py:3"]


#: One package per engine (``evaluators/<engine>/``: ``evaluator.py``, and ``runner.py`` unless it runs another
#: engine's runner, as exl2-reference runs the transformers one).
ENGINE_PACKAGES = ("llamacpp", "vllm", "exllamav2", "transformers", "exl2_reference")
FORMAT_PACKAGES = ("gguf", "awq", "exl2")
#: What a runner may load of ``pipeline``: the standard-library-only modules (llama_load: the llama.cpp runner's
#: reason-keeping load), and the EXL2 codec (torch only).
RUNNER_PIPELINE = frozenset({"pipeline", "pipeline.cpu", "pipeline.fs", "pipeline.errors", "pipeline.exl2_codec",
                             "pipeline.llama_load"})
#: What a runner may load of ``evaluators`` besides its own package: the protocol, the speed definitions and the
#: shared EXL2 loader.
RUNNER_SHARED = frozenset({"evaluators", "evaluators.protocol", "evaluators.speed", "evaluators.exl2_loader"})


def _loaded_after(imports: str) -> list[str]:
    """The modules of the core, of pydantic, gguf and yaml that ``import {imports}`` loads in a fresh interpreter."""
    code = (f"import sys; import {imports}; "
            "print('\\n'.join(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('pydantic', 'pydantic_settings', 'gguf', 'yaml', 'pipeline', 'evaluators'))))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def import_circles(packages: tuple[str, ...] = PACKAGES) -> list[list[str]]:
    """Every set of modules that import each other in a circle (strongly connected components of the
    import graph, from grimp, import-linter's own graph builder; lazy imports inside functions count)."""
    import grimp

    graph = grimp.build_graph(*packages, include_external_packages=False)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.find_modules_directly_imported_by(module)):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return circles


def test_no_import_circle() -> None:
    assert import_circles() == []


def test_worker_and_runner_packages_import_nothing_of_the_core() -> None:
    """Workers and runners run as ``python -m converters.<format>.workers.X`` / ``evaluators.<engine>.runner``
    in tool interpreters without pydantic or gguf: the package roots, every format and engine package's
    included, import nothing."""
    engines = sorted(p.name for p in (ROOT / "evaluators").iterdir() if (p / "evaluator.py").is_file())
    assert engines == sorted(ENGINE_PACKAGES), "an engine package is missing from ENGINE_PACKAGES (or vice versa)"
    formats = sorted(p.parent.name for p in (ROOT / "converters").glob("*/converter.py"))
    assert formats == sorted(FORMAT_PACKAGES), "a format package is missing from FORMAT_PACKAGES (or vice versa)"
    roots = ["converters", "evaluators", *(f"converters.{f}" for f in FORMAT_PACKAGES),
             *(f"converters.{f}.workers" for f in FORMAT_PACKAGES), *(f"evaluators.{e}" for e in ENGINE_PACKAGES)]
    loaded = _loaded_after(", ".join(roots))
    assert set(loaded) == {"evaluators", *(f"evaluators.{e}" for e in ENGINE_PACKAGES)}, loaded


def test_runners_import_only_the_protocol_and_their_engine() -> None:
    """Each runner (and the shared EXL2 loader the transformers runner uses) loads, of Quantyard, only the
    protocol, the EXL2 loader and codec and the stdlib-only ``pipeline`` modules: never pydantic, gguf,
    ``evaluators.base`` or another engine's package."""
    runners = sorted(f"evaluators.{p.parent.name}.runner" for p in (ROOT / "evaluators").glob("*/runner.py"))
    assert runners == sorted(f"evaluators.{e}.runner" for e in ENGINE_PACKAGES if e != "exl2_reference")
    for module in [*runners, "evaluators.exl2_loader"]:
        own = {module, module.rpartition(".")[0]}
        bad = [m for m in _loaded_after(module)
               if not (m in own or m in RUNNER_SHARED or m in RUNNER_PIPELINE)]
        assert not bad, f"{module} loads {bad}"


if __name__ == "__main__":
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    counts = scan(where)
    for kind, places in counts.items():
        print(f"{kind}: {len(places)}")
        for place in places:
            print(f"  {place}")
    if where == ROOT:
        print(f"import circles: {import_circles()}")
