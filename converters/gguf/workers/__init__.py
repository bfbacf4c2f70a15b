"""GGUF workers, run as ``python -m converters.gguf.workers.<name>`` with llama-cpp-python."""
