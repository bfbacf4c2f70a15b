"""Worker side of the converter request/result protocol (standard library only: workers run in managed
tool environments where nothing else of Quantyard is installed).

A worker is started as ``python -m converters.workers.NAME REQUEST.json``; the request names the
``result`` path, which the worker writes last and atomically: a missing result file means it died.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def read_request(module: str, extra_usage: str = "") -> dict[str, Any]:
    """The JSON request named by the only command-line argument."""
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python -m {module} REQUEST.json{extra_usage}")
    return dict(json.loads(Path(sys.argv[1]).read_text()))


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` atomically (temporary file, then rename)."""
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
