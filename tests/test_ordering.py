"""The suite's file order (tests/conftest.py ``file_order``): what make test's workers are handed, and when."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import SHARED_BUILDS, file_order

TESTS = Path(__file__).resolve().parent


class _Item:
    """What file_order reads of a collected test: its file, its fixtures' closure and its markers."""

    def __init__(self, path: str, fixtures: tuple[str, ...] = (), slow: bool = False) -> None:
        self.path = Path(path)
        self.fixturenames = list(fixtures)
        self._slow = slow

    def get_closest_marker(self, name: str) -> object:
        return object() if name == "slow" and self._slow else None


def test_files_that_would_wait_for_a_shared_build_go_to_their_groups_end() -> None:
    items = [
        _Item("a.py"), _Item("a.py", ("demo_registry_template",)),
        _Item("b.py", ("real_registry_template",), slow=True),
        _Item("c.py", ("real_registry_template", "tmp_path"), slow=True),  # would wait for b's build
        _Item("d.py", ("demo_registry_template",)),  # would wait for a's
        _Item("e.py", ("real_registry_template", "awq_registry_template"), slow=True),  # builds the AWQ one
        _Item("f.py"),
    ]
    order = [p.name for p in file_order(items)]  # type: ignore[arg-type]
    assert order == ["b.py", "e.py", "c.py", "a.py", "f.py", "d.py"]  # to the end of its group: slow, then not
    assert file_order(items[::-1])[0].name == "e.py"  # slow first whatever the collection order; stable within


def _fixtures_calling_once_per_run() -> set[str]:
    found = set()
    for source in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(call, ast.Call) and getattr(call.func, "id", None) == "once_per_run"
                    for call in ast.walk(node)):
                found.add(node.name)
    return found


def test_every_shared_build_is_known_to_the_order() -> None:
    """A new once_per_run fixture missing from SHARED_BUILDS would put its waiting files early again."""
    assert _fixtures_calling_once_per_run() == set(SHARED_BUILDS)


def test_pytest_runs_files_in_that_order() -> None:
    """The hook is in place: pytest's own collection of two slow files using the real-checkpoint registry and a
    slow one using no shared build runs the builder, then the other slow file, then the file that only waits
    (collected in the order builder, waiter, other)."""
    files = ["tests/evaluators/test_kld_crosscheck.py", "tests/flows/test_real_checkpoint.py",
             "tests/reliability/test_crash.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                         cwd=TESTS.parent, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    seen = list(dict.fromkeys(line.split("::")[0] for line in out.stdout.splitlines() if "::" in line))
    assert seen == [files[0], files[2], files[1]]
