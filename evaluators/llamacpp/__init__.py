"""The llama.cpp engine: GGUF on llama-cpp-python. ``evaluator.py`` (core side), ``runner.py`` (run as
``python -m evaluators.llamacpp.runner REQUEST.json``). Imports nothing: see evaluators/__init__.py."""
