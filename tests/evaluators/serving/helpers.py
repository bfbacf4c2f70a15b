"""Helpers for server tests: a streamed completion, process liveness from /proc, and a run killed while its
server runs."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from evaluators.serving.spec import ServerSpec
from pipeline.proc import REPO_ROOT, child_env


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until none of ``pids`` runs; returns those still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def stream_completion(base_url: str, model: str, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
    """One streamed ``/v1/completions`` request with ``stream_options.include_usage``: the text, the number of
    chunks with text, the usage the server reported, and whether the stream ended with ``[DONE]``."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    text, chunks, usage, done = "", 0, None, False
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as res:
        res.raise_for_status()
        for line in res.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    text += choice["text"]
                    chunks += 1
    return {"text": text, "chunks": chunks, "usage": usage, "done": done}


def kill_a_serving_run(spec: ServerSpec, settings: dict[str, Any], tmp: Path, timeout_s: float) -> dict[str, Any]:
    """Start ``spec``'s server from a child Python process, SIGKILL that process once the server is healthy, and
    return what the child reported (``keeper``, ``server``, ``tree``) with ``left``: the pids of the server's
    tree still running 10 s later, and ``kill_to_gone_s``."""
    req = tmp / "serve-request.json"
    req.write_text(json.dumps({"spec": spec.model_dump(mode="json"), "settings": settings,
                               "log_dir": str(tmp / "logs")}))
    child = subprocess.Popen([sys.executable, "-m", "tests.evaluators.serving.serve_child", str(req)],
                             stdout=subprocess.PIPE, cwd=REPO_ROOT, env=child_env())
    assert child.stdout is not None
    try:
        ready, _, _ = select.select([child.stdout], [], [], timeout_s)
        line = child.stdout.readline() if ready else b""
        assert line, f"the child did not report a running server within {timeout_s} s (exit {child.poll()})"
        info = json.loads(line)
        pids = [info["keeper"], *info["tree"]]
        assert all(alive(p) for p in pids)
        t0 = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        info["left"] = wait_gone(pids, 10.0)
        info["kill_to_gone_s"] = time.monotonic() - t0
        return info
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
