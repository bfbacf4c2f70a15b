"""Converters, one module per format, registered in the explicit dict below (import paths, so
that importing this package stays cheap). To add a format, see converters/README.md."""

from __future__ import annotations

from importlib import import_module
from typing import Any

CONVERTERS: dict[str, str] = {
    "gguf": "converters.gguf:GGUFConverter",
    "awq": "converters.awq:AWQConverter",
    "exl2": "converters.exl2:EXL2Converter",
}


def converter_class(fmt: str) -> Any:
    """The converter class registered for format ``fmt``.

    Raises:
        UnknownFormatError: ``fmt`` is not registered (the message lists the known formats).
    """
    from pipeline.errors import UnknownFormatError

    try:
        module, _, cls = CONVERTERS[fmt].partition(":")
    except KeyError:
        raise UnknownFormatError(f"unknown format {fmt!r}; known: {', '.join(sorted(CONVERTERS))}") from None
    return getattr(import_module(module), cls)
