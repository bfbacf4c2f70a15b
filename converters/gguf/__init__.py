"""GGUF (llama.cpp): the converter (``converter.py``), its importance matrices (``imatrix.py``), splits
(``split.py``), tokenizer parity (``tokenizer.py``), file checks (``sanity.py``) and the workers that run in
llama-cpp-python (``workers/``). This ``__init__`` imports nothing: workers run in tool interpreters."""
