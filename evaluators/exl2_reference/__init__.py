"""The exl2-reference engine: EXL2 dequantized by Quantyard's codec and scored by transformers on CPU
(``evaluator.py``). It has no runner of its own: it runs ``evaluators.transformers.runner`` with
``loader="exl2"``, which loads through the shared ``evaluators/exl2_loader.py``. Imports nothing: see
evaluators/__init__.py."""
