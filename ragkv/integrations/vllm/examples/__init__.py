"""Runnable examples of the vLLM integration (GPU machine for serve_and_query.sh)."""
