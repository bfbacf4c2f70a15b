"""Which class converts a format: that format's line in :data:`pipeline.formats.FORMATS` names it by
import path, imported when used. To add a format, see converters/README.md."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from pipeline.formats import format_info


def converter_class(fmt: str) -> Any:
    """The converter class of format ``fmt``.

    Raises:
        UnknownFormatError: ``fmt`` is not a known format (the message lists the known ones).
    """
    module, _, cls = format_info(fmt).converter.partition(":")
    return getattr(import_module(module), cls)
