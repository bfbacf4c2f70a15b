"""Worker modules run as subprocesses (``python -m converters.workers.NAME``), in the core
environment or a managed tool environment. They import only the standard library, numpy and
their tool, never the rest of Quantyard, so they run under any interpreter."""
