"""The core suite's fixtures: ragkv.testing's (``redis-server`` processes on free loopback ports, one
torch thread, the embedder, an empty fidelity cache); hypothesis without wall-time limits."""

from __future__ import annotations

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
