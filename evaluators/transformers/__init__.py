"""The transformers engine: the cross-check of AWQ in the ``awq`` tool environment (``evaluator.py``), and
the runner the reference and the exl2-reference engine also use (``runner.py``, run as
``python -m evaluators.transformers.runner REQUEST.json``). Imports nothing: see evaluators/__init__.py."""
