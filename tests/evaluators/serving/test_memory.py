"""Memory measurement on a real process tree: a parent whose child allocates and touches 64 MiB."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evaluators.serving.memory import MemorySampler, tree_pids, weights_bytes

MIB = 2**20
#: Parent sleeps; its child waits for a line on stdin, allocates 64 MiB, touches every page and sleeps.
TREE = ("import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import sys, time; sys.stdin.readline(); "
        "b = bytearray(64 * 2**20); b[::4096] = b\"x\" * len(b[::4096]); print(flush=True); time.sleep(60)'], "
        "stdin=sys.stdin)\n"
        "time.sleep(60)\n")


def test_weights_bytes_counts_weight_files_only(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "tokenizer.json").write_bytes(b"\0" * 50)
    (tmp_path / "one.gguf").write_bytes(b"\0" * 7)
    assert weights_bytes(tmp_path) == 1007
    assert weights_bytes(tmp_path / "one.gguf") == 7
    with pytest.raises(FileNotFoundError):
        weights_bytes(tmp_path / "missing")


def test_sampler_sees_a_childs_allocation_and_the_level_peak() -> None:
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    try:
        while len(tree_pids(proc.pid)) < 2:
            time.sleep(0.05)
        with MemorySampler(proc.pid, interval_s=0.05) as sampler:
            before = sampler.snapshot()
            assert len(before.pids) == 2 and before.rss_bytes > 0 and before.pss_bytes is not None
            sampler.start_level()
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            deadline = time.monotonic() + 20
            while sampler.snapshot().rss_bytes < before.rss_bytes + 60 * MIB and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
            peak = sampler.end_level()
        assert peak.rss_peak_bytes >= before.rss_bytes + 60 * MIB, (peak, before)
        assert peak.samples >= 3 and peak.device_peak_bytes is None
        assert sampler.peak_rss_bytes >= peak.rss_peak_bytes
    finally:
        for pid in reversed(tree_pids(proc.pid)):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
