"""EXL2: the converter (``converter.py``), the reference-cpu quantizer (``quantizer.py``: measurement,
GPTQ, bit allocation; ``reference.py``: the whole conversion) and the workers (``workers/``). The format
codec itself (designed bit-exact with ExLlamaV2; what the GPU check showed: ``pipeline/status.py``) is
``pipeline/exl2_codec.py`` (engines read it too). This ``__init__`` imports nothing."""
