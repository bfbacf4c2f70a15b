"""The ExLlamaV2 engine: EXL2 on CUDA in the ExLlamaV2 interpreter. ``evaluator.py`` (core side),
``runner.py`` (run as ``python -m evaluators.exllamav2.runner REQUEST.json``). Imports nothing: see
evaluators/__init__.py."""
