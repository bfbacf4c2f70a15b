"""Serving: each variant behind its engine's OpenAI-compatible server, load-tested.

Imports nothing: tool interpreters import this package to run its runners.
"""
