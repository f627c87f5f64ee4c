"""The core suite's fixtures: ragkv.testing's (``redis-server`` processes on free loopback ports, one
torch thread, the embedder, an empty fidelity cache); hypothesis without wall-time limits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings

from ragkv.testing import worker_threads
from ragkv.testing.fixtures import (  # noqa: F401  (fixtures for every test below)
    embedder,
    fidelity_cache,
    make_redis_server,
    one_thread,
    redis_server,
)

# each pytest-xdist worker takes its share of the cores (tests.helpers.worker_threads); fixtures that want
# one thread (``one_thread``) still set it
torch.set_num_threads(worker_threads())

#: hypothesis's wall-time checks (200 ms per example, "too slow" data generation) measure the
#: neighbours on a shared 2-core machine, not the code: off for the whole suite (issue 36)
settings.register_profile("ragkv", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ragkv")

#: modules whose async tests share one event loop (a client bound to its first loop, like ChatOpenAI's)
SHARED_LOOP_MODULES = ("test_chatopenai_standard.py",)


def pytest_collection_modifyitems(items):
    """Async tests of :data:`SHARED_LOOP_MODULES` run on one module-scoped loop (a marker on the sync
    tests would only warn, so it goes on the coroutines alone)."""
    import inspect

    for item in items:
        fn = getattr(item, "function", None)
        if item.path.name in SHARED_LOOP_MODULES and fn is not None and inspect.iscoroutinefunction(fn):
            item.add_marker(pytest.mark.asyncio(loop_scope="module"), append=False)
