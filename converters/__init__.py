"""Converters, one per format (see converters/README.md); :func:`converters.lookup.converter_class` finds
the one of a format. This package's ``__init__`` imports nothing: workers (``converters.<format>.workers.*``) run
in foreign interpreters (the tool environments) that have neither pydantic nor gguf."""
