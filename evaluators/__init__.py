"""Evaluators: one shared method (window sets, reference, metrics, the runner protocol) and one package per
engine (``evaluators/<engine>/``: ``evaluator.py`` and ``runner.py``).

The engines are the table :data:`evaluators.engines.ENGINES`. This package's ``__init__`` imports nothing,
nor does any engine package's: runners run as ``python -m evaluators.<engine>.runner REQUEST.json`` in
foreign interpreters that have neither pydantic nor gguf. To add an engine, see evaluators/README.md.
"""
