"""GuideLLM 0.8.1's Poisson start race, and its mend (evaluators/serving/guidellm_backend.py), in the real
guidellm environment: when the start time releases the workers, is the arrival offset already set?"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from pipeline import envs
from pipeline.config import Settings

REPO = Path(__file__).resolve().parents[3]
#: Builds GuideLLM's own Poisson strategy with its shared state, replaces the event that releases the workers
#: by one that records the offset a woken worker would read, then starts it: once as shipped, once mended.
PROBE = """
import json, multiprocessing, sys
from guidellm.scheduler.strategies import AsyncPoissonStrategy

class Event:
    def __init__(self, strategy): self.strategy, self.seen = strategy, None
    def set(self): self.seen = self.strategy._offset.value
    def wait(self, timeout=None): return True

def offset_at_release():
    s = AsyncPoissonStrategy(rate=1.5, random_seed=0)
    s.init_processes_timings(worker_count=1, max_concurrency=1, mp_context=multiprocessing.get_context("spawn"))
    s._processes_init_event = Event(s)
    s.init_processes_start(1000.0)
    return s._processes_init_event.seen, s._offset.value

shipped = offset_at_release()
from evaluators.serving import guidellm_backend
guidellm_backend.install()
print(json.dumps({"shipped": shipped, "mended": offset_at_release()}))
"""


def test_the_poisson_offset_is_set_before_the_workers_are_released(cache_dir: Path) -> None:
    python = envs.python_for("guidellm", Settings(cache_dir=cache_dir))
    out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["shipped"] == [-1.0, 1000.0]  # the race as shipped: released while the offset is still -1
    assert seen["mended"] == [1000.0, 1000.0]
