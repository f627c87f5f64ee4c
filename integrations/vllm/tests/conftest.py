"""Fixtures of ragkv-vllm's tests: the core suite's (one torch thread, the embedder), importable from a checkout."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
if (
    str(REPO) not in sys.path
):  # the core suite's helpers (tests.helpers) and eval.harness live in the checkout
    sys.path.insert(0, str(REPO))

from tests.conftest import embedder, one_thread  # noqa: E402, F401  (fixtures, re-exported)
