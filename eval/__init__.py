"""Evaluation and benchmark scripts (run as python -m eval.<name>)."""
