"""What the machine has and what work takes (pipeline/resources.py), measured on real processes."""

from __future__ import annotations

import mmap
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.resources import GIB, Sampler, descendants, memory, parse_size, tree_memory

ALLOCATE = "import time; x = bytearray({n}); x[::4096] = b'1' * len(x[::4096]); time.sleep({s})"


def test_sizes_are_binary_units() -> None:
    assert parse_size("8G") == 8 * GIB and parse_size("512M") == 512 * 2**20 and parse_size("1.5GiB") == 3 * GIB // 2
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError, match="expected a size"):
        parse_size("lots")


def test_a_budget_lowers_what_is_available_and_says_so() -> None:
    machine = memory()
    assert 0 < machine.available <= machine.total
    small = memory(budget=256 * 2**20)
    assert small.available == 256 * 2**20 and small.limited_by == "QUANTYARD_MEMORY_BUDGET"
    assert "256 MiB available (QUANTYARD_MEMORY_BUDGET" in small.describe()


def test_the_sampler_counts_a_tool_started_during_the_work_and_not_one_already_running(tmp_path: Path) -> None:
    before = subprocess.Popen([sys.executable, "-c", ALLOCATE.format(n=300 * 2**20, s=5)])
    try:
        with Sampler(period=0.05) as s:
            subprocess.run([sys.executable, "-c", ALLOCATE.format(n=200 * 2**20, s=0.5)], check=True)
    finally:
        before.kill()
        before.wait()
    assert s.usage is not None
    assert 200 * 2**20 <= s.usage.peak_process_bytes < 450 * 2**20, s.usage  # the new child, not the 300 MB one
    assert s.usage.peak_in_use_bytes >= s.usage.start_in_use_bytes


def test_a_memory_mapped_file_is_not_a_process_own_memory(tmp_path: Path) -> None:
    """What makes the llama.cpp reference fit: a model file mapped and read is page cache, not the process's."""
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\1" * (128 * 2**20))
    own = tree_memory()
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        total = sum(m[i] for i in range(0, len(m), 4096))  # touch every page
        assert total == len(m) // 4096
        assert tree_memory() - own < 32 * 2**20


def test_descendants_are_found() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    try:
        assert child.pid in descendants(__import__("os").getpid())
    finally:
        child.kill()
        child.wait()
