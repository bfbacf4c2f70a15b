"""Worker side of the converter request/result protocol (standard library and the stdlib-only
``pipeline.fs``: workers run in managed tool environments that have neither pydantic nor gguf).

A worker is started as ``python -m converters.<format>.workers.NAME REQUEST.json``; the request names the
``result`` path, which the worker writes last and atomically: a missing result file means it died.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pipeline.fs import write_atomic


def read_request(module: str, extra_usage: str = "") -> dict[str, Any]:
    """The JSON request named by the only command-line argument."""
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python -m {module} REQUEST.json{extra_usage}")
    return dict(json.loads(Path(sys.argv[1]).read_text()))


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` atomically (pipeline.fs: temporary file, then rename)."""
    write_atomic(Path(path), json.dumps(result, indent=1))
