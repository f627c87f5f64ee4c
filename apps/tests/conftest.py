"""Fixtures of ragkv-server's tests: ragkv.testing's (Redis servers, one torch thread, the embedder), and
one event loop per module for clients bound to their first loop."""

from __future__ import annotations

import inspect

import pytest

from ragkv.testing.fixtures import (  # noqa: F401  (fixtures, re-exported)
    embedder,
    fidelity_cache,
    make_redis_server,
    one_thread,
    redis_server,
)

#: modules whose async tests share one event loop (a client bound to its first loop, like ChatOpenAI's)
SHARED_LOOP_MODULES = ("test_chatopenai_standard.py",)


def pytest_collection_modifyitems(items):
    """Async tests of :data:`SHARED_LOOP_MODULES` run on one module-scoped loop (once, if the core
    suite's conftest marked them already in the same run)."""
    for item in items:
        fn = getattr(item, "function", None)
        if item.path.name not in SHARED_LOOP_MODULES or fn is None or not inspect.iscoroutinefunction(fn):
            continue
        mark = item.get_closest_marker("asyncio")
        if mark is None or mark.kwargs.get("loop_scope") != "module":
            item.add_marker(pytest.mark.asyncio(loop_scope="module"), append=False)
