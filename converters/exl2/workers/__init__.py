"""EXL2 workers, run as ``python -m converters.exl2.workers.<name>``."""
