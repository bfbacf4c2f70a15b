"""AWQ: the converter (``converter.py``), its folder checks (``sanity.py``) and the workers that run in the
llm-compressor and AutoAWQ environments (``workers/``). This ``__init__`` imports nothing."""
