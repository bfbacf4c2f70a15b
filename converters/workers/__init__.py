"""Worker modules run as subprocesses (``python -m converters.workers.NAME``), in the core
environment or a managed tool environment. They import only the standard library, numpy, their
tool and ``pipeline.fs`` (standard library only, as is ``pipeline/__init__.py``), never the rest of
Quantyard, so they run under any interpreter."""
