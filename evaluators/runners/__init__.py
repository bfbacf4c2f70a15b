"""Engine runners, each executed as ``python -m evaluators.runners.<engine> REQUEST.json`` in the
engine's own interpreter. They import only ``evaluators.runners._protocol``, numpy and their engine."""
