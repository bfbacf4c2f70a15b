"""A run that starts a server and is then killed: ``python -m tests.evaluators.serving.serve_child REQUEST.json``.

REQUEST.json holds ``spec`` (a ServerSpec dump), ``settings`` (Settings fields) and ``log_dir``. The child
starts the server, prints one JSON line (keeper and server pids, the server's whole process tree, base URL)
and sleeps inside the ``with`` block until it is killed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from evaluators.serving.memory import tree_pids
from evaluators.serving.server import start_server
from evaluators.serving.spec import ServerSpec
from pipeline.config import Settings


def main() -> None:
    req = json.loads(Path(sys.argv[1]).read_text())
    spec = ServerSpec.model_validate(req["spec"])
    settings = Settings(**req["settings"])
    with start_server(spec, settings, Path(req["log_dir"])) as srv:
        print(json.dumps({"keeper": srv.keeper_pid, "server": srv.pid, "tree": tree_pids(srv.pid),
                          "base_url": srv.base_url}), flush=True)
        time.sleep(3600)


if __name__ == "__main__":
    main()
