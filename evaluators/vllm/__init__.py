"""The vLLM engine: AWQ on vLLM in the ``vllm`` tool environment. ``evaluator.py`` (core side), ``runner.py``
(run as ``python -m evaluators.vllm.runner REQUEST.json``). Imports nothing: see evaluators/__init__.py."""
