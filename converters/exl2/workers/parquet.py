"""Write calibration text as the parquet file exllamav2's ``convert_exl2 -c`` reads (runs in the
ExLlamaV2 interpreter, which has pandas and fastparquet as exllamav2 dependencies).

JSON request on stdin: ``{"text_file": path, "out": path}``. The whole text is one row of a
``text`` column: exllamav2 tokenizes each row and concatenates the ids, so one row keeps the text
exactly as given.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.fs import atomic_path


def main() -> int:
    req = json.loads(sys.stdin.read())
    import pandas

    text = Path(req["text_file"]).read_text(encoding="utf-8")
    out = Path(req["out"])
    with atomic_path(out) as tmp:
        pandas.DataFrame({"text": [text]}).to_parquet(tmp, engine="fastparquet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
