"""Quantyard core: domain types, plans, settings, errors and the CLI."""

__version__ = "0.1.0"
