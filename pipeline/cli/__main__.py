"""``python -m pipeline.cli``: the same command line as ``quantyard``."""

from pipeline.cli import main

main()
