"""bench/pipeline_vs_llamacpp.py's CPU accounting (Load): a way's own processes against everything else on
the machine. A child that burns one core for a known CPU time must be counted as the way's own, not as other
load, and the wall time must cover it."""

from __future__ import annotations

import os
import subprocess
import sys
from types import ModuleType

import pytest

from tests.bench import load_script

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0:\n    pass\n"


@pytest.fixture(scope="module")
def pv() -> ModuleType:
    return load_script("pipeline_vs_llamacpp")


def test_a_ways_child_is_counted_as_its_own(pv: ModuleType) -> None:
    def way() -> object:
        subprocess.run([sys.executable, "-c", BURN], check=True)
        return pv.Way()

    load = pv.measured_load(way).load
    assert load is not None
    # the child's second of CPU (plus its interpreter start) is the way's own ...
    assert 1.0 <= load.ours_s < 3.0
    assert load.wall_s >= 1.0
    # ... and not counted again as the machine's other load: the two together cannot exceed what the cores
    # could do over the wall time (0.02 s of slack per core: two clock ticks at the usual 100 Hz)
    cores = os.cpu_count() or 1
    assert load.ours_s + load.other_s <= cores * (load.wall_s + 0.02)
    assert load.steal_s >= 0.0
    assert "its own processes" in load.text() and "hypervisor steal" in load.text()
