"""Small builders for registry tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.specs import SourceKind, SourceRef
from registry.store import RegisterRequest

SRC = SourceRef(kind=SourceKind.LOCAL, path="/x", content_hash="ab" * 32)
HUB = SourceRef(kind=SourceKind.HUB, path="/hub", repo_id="acme/tiny", revision="main", commit="c0ffee" * 6 + "ab12")
TOOL = {"name": "llama.cpp", "llama_cpp_python": "0.3.36", "llama_cpp_commit": "abc123"}


def request(tmp: Path, name: str = "Q8_0", key: str = "k1", data: bytes = b"gguf-bytes" * 100,
            model: str = "demo", source: SourceRef = SRC, **kw: Any) -> RegisterRequest:
    f = tmp / f"{model.replace('/', '_')}-{name}-{key}.bin"
    f.write_bytes(data)
    return RegisterRequest(model=model, architecture="LlamaForCausalLM", source=source, variant=name, format="gguf",
                           spec={"type": name}, build_key=key, lineage={"tool": TOOL, "built_by": key.split("-")[0]},
                           files={f"demo-{name}.gguf": f}, **kw)


def flip_byte(path: Path, offset: int = 10) -> None:
    """Corrupt one byte of a local blob in place."""
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
