"""AWQ workers, run as ``python -m converters.awq.workers.<name>`` in their tool environment."""
