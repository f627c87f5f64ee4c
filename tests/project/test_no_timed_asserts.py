"""No test asserts on wall time, except the few named here with a bound far above the typical value.

On a shared 2-core machine (two pytest-xdist workers, other jobs) a stopwatch measures the neighbours,
not the code: ``longest stall 104 ms`` against a 100 ms bound failed at random. A property is checked
by counting (operations, calls), by ordering (events the test controls) or by yes/no witnesses; the
precise figures live in the benchmarks (``eval.bench_timing``, ``eval.bench_worst_request``,
docs/BENCHMARKS.md "Timing properties moved out of the suite").

The lint parses every test file (``tests/**/*.py`` and each distribution's ``tests/``) with :mod:`ast`
and reports an ``assert`` (or an ``assert*`` call, or an ``if`` that fails the test) whose expression
involves a *difference* of clock readings (``time.perf_counter()``, ``time.monotonic()``,
``time.time()`` and their ``_ns`` forms): directly, through a variable or container that holds one, or
through a helper function that returns one; and a hypothesis ``settings(deadline=...)`` other than
None (the suite's profile has none). A polling deadline (``deadline = time.monotonic() + 10``,
``while time.monotonic() < deadline``) is no difference: it waits for a condition and is not reported.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/ (this file: tests/project/)
#: the distributions' test folders (apps/, integrations/*: issue 40), linted alike
DIST_TESTS = (
    "apps/tests",
    "integrations/langchain/tests",
    "integrations/llama-index/llms/tests",
    "integrations/llama-index/retrievers/tests",
    "integrations/vllm/tests",
)


def all_test_modules() -> list[Path]:
    """Every test module of the core (tests/ and its unit/, e2e/, project/ folders) and of each
    distribution (a missing folder fails)."""
    files = sorted(TESTS.rglob("*.py"))
    for folder in DIST_TESTS:
        root = TESTS.parent / folder
        assert root.is_dir(), f"{root} is missing: the lint walks it"
        files += sorted(root.rglob("*.py"))
    return files


CLOCKS = frozenset({"perf_counter", "monotonic", "time", "perf_counter_ns", "monotonic_ns", "time_ns"})
#: methods that put a value into a container (the container then holds it)
FILLERS = frozenset({"append", "extend", "insert", "add", "appendleft", "update", "put", "put_nowait"})

#: the duration asserts that remain: ``file::function`` (the file's path in the checkout) -> why only time
#: witnesses it, and its bound (at least 10x the typical value, so it catches seconds where milliseconds
#: are expected)
ALLOWED: dict[str, str] = {
    "apps/tests/test_faults.py::test_slow_bodies_get_408_and_half_open_connections_cannot_starve_healthz": (
        "a stalled body's 408 comes after body_timeout_s 1.5 s: lower bound 1.2 s (load only lengthens "
        "it), upper 15 s (10x); /healthz beside half-open connections: 0.107 s measured "
        "(eval.bench_worst_request, 300 of them), bound 2 s (19x; without the cap: 503s)"
    ),
    "apps/tests/test_faults.py::test_32_clients_race_deletes_and_queries_against_a_serial_reference": (
        "a connection that never finishes its head is cut after header_timeout_s 1.5 s: bounds 1-15 s "
        "(10x); /healthz from this process while its 32 client threads query and ingest: 2.3 s seen at "
        "load average 7 (eval.bench_ingest_load: 48-148 ms from its own process), bound 25 s (10x); "
        "test_healthz_answers_while_every_worker_is_held checks health never queues, by ordering"
    ),
    "apps/tests/test_security.py::test_long_ndjson_line_does_not_stall_the_server": (
        "a 36 MiB NDJSON line: 0.41 s, /healthz meanwhile 0.10 s worst (eval.bench_worst_request "
        "--max-line-bytes 37748736), 0.61 s and 0.29 s at load average 10; bounds 6 s and 3 s (10x "
        "those; the quadratic assembly took 6 s quiet); test_ndjson_upload_scans_each_byte_once_"
        "whatever_its_line_length counts the linear scan"
    ),
}


@dataclass
class _Scope:
    """What one test function (nested functions included) binds to clock readings and durations."""

    clock: set[str] = field(default_factory=set)  # names holding a clock reading (or a deadline)
    duration: set[str] = field(default_factory=set)  # names holding a difference of readings


def _key(node: ast.AST) -> str | None:
    """The name a value is bound to: ``x``, ``self.x``; a subscript or container binds its base."""
    while isinstance(node, ast.Subscript | ast.Starred):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _key(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


class _Module:
    """Clock names a module imports and the helper functions whose return value is a duration."""

    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.time_modules = {"time"}  # ``import time [as t]``
        self.clock_funcs: set[str] = set()  # ``from time import perf_counter [as pc]``
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.time_modules |= {a.asname or a.name for a in node.names if a.name == "time"}
            elif isinstance(node, ast.ImportFrom) and node.module == "time":
                self.clock_funcs |= {a.asname or a.name for a in node.names if a.name in CLOCKS}
        # helpers returning a duration: name -> per tuple position (None: the whole value is one)
        self.returns: dict[str, list[bool] | None] = {}
        self._pairs: dict[ast.AST, list[tuple[ast.AST, ast.AST]]] = {}  # bindings per function
        self.reads_clock = any(self.is_clock_call(n) for n in ast.walk(tree))
        if not self.reads_clock:
            return  # no clock reading: nothing here can be a duration
        funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        changed = True
        while changed:  # helpers calling helpers: to a fixed point (merging only ever grows)
            changed = False
            for fn in funcs:
                got = self._returned(fn)
                if got is False:
                    continue
                merged = _merge(self.returns[fn.name], got) if fn.name in self.returns else got
                if fn.name not in self.returns or merged != self.returns[fn.name]:
                    self.returns[fn.name] = merged
                    changed = True

    def _returned(self, fn: ast.AST) -> list[bool] | None | bool:
        """Which parts of ``fn``'s return values are durations: False if none."""
        values = [n.value for n in _own_nodes(fn) if isinstance(n, ast.Return) and n.value is not None]
        if not values:
            return False
        scope = self.scope(fn)
        if all(isinstance(v, ast.Tuple) for v in values) and len({len(v.elts) for v in values}) == 1:
            flags = [
                any(self.is_duration(v.elts[i], scope) for v in values) for i in range(len(values[0].elts))
            ]
            return flags if any(flags) else False
        return None if any(self.is_duration(v, scope) for v in values) else False

    # ---- expressions ---------------------------------------------------------------------------
    def is_clock_call(self, node: ast.AST) -> bool:
        """``time.perf_counter()`` and the like (``t.monotonic()`` after ``import time as t``)."""
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in CLOCKS and isinstance(f.value, ast.Name):
            return f.value.id in self.time_modules
        return isinstance(f, ast.Name) and f.id in self.clock_funcs

    def is_clock(self, node: ast.AST, scope: _Scope) -> bool:
        """Whether ``node`` involves a clock reading (a call, or a name bound to one)."""
        for n in ast.walk(node):
            if self.is_clock_call(n):
                return True
            if isinstance(n, ast.Name | ast.Attribute) and _key(n) in scope.clock:
                return True
        return False

    def is_duration(self, node: ast.AST, scope: _Scope) -> bool:
        """Whether ``node`` involves a difference of clock readings (directly, by name or by helper)."""
        for n in ast.walk(node):
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub):
                if self.is_clock(n.left, scope) or self.is_clock(n.right, scope):
                    return True
            if isinstance(n, ast.Name | ast.Attribute) and _key(n) in scope.duration:
                return True
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in self.returns:
                return True
        return False

    def _parts(self, value: ast.AST, scope: _Scope, width: int) -> list[bool] | None:
        """Per-position duration flags of a value unpacked into ``width`` targets, or None."""
        if isinstance(value, ast.Tuple) and len(value.elts) == width:
            return [self.is_duration(v, scope) for v in value.elts]
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            flags = self.returns.get(value.func.id, False)
            if isinstance(flags, list) and len(flags) == width:
                return flags
        return None

    # ---- bindings ------------------------------------------------------------------------------
    def scope(self, fn: ast.AST) -> _Scope:
        """Names bound to clock readings and durations in ``fn`` (flow-insensitive, to a fixed point)."""
        if fn not in self._pairs:
            self._pairs[fn] = [pair for node in ast.walk(fn) for pair in _bindings(node)]
        pairs = self._pairs[fn]
        scope = _Scope()
        size = -1
        while size != len(scope.clock) + len(scope.duration):
            size = len(scope.clock) + len(scope.duration)
            for target, value in pairs:
                self._bind(target, value, scope)
        return scope

    def _bind(self, target: ast.AST, value: ast.AST, scope: _Scope) -> None:
        """Bind ``target`` to what ``value`` holds (a tuple target: position by position if known)."""
        if isinstance(target, ast.Tuple | ast.List):
            parts = self._parts(value, scope, len(target.elts))
            for i, t in enumerate(target.elts):
                if parts is None:
                    self._bind(t, value, scope)
                elif parts[i] and _key(t) is not None:
                    scope.duration.add(_key(t))
            return
        key = _key(target)
        if key is None:
            return
        if self.is_duration(value, scope):
            scope.duration.add(key)
        elif self.is_clock(value, scope):
            scope.clock.add(key)


def _merge(a: list[bool] | None, b: list[bool] | None) -> list[bool] | None:
    """Two helpers of one name: a position is a duration if it is in either (None: the whole value)."""
    if a is None or b is None or len(a) != len(b):
        return None
    return [x or y for x, y in zip(a, b, strict=True)]


def _own_nodes(fn: ast.AST) -> list[ast.AST]:
    """The nodes of ``fn``'s body outside its nested functions (whose returns are their own)."""
    out, todo = [], list(ast.iter_child_nodes(fn))
    while todo:
        n = todo.pop()
        out.append(n)
        if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(n))
    return out


def _bindings(node: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """``(target, value)`` pairs a statement or expression binds: assignments, loop variables,
    comprehension variables, ``with ... as``, and values put into containers."""
    if isinstance(node, ast.Assign):
        return [(t, node.value) for t in node.targets]
    if isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr) and node.value is not None:
        return [(node.target, node.value)]
    if isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
        return [(node.target, node.iter)]
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return [(node.optional_vars, node.context_expr)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FILLERS:
        return [(node.func.value, arg) for arg in node.args]
    if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
        return []  # its variables: ast.comprehension above; its value binds where it is assigned
    return []


def _fails(body: list[ast.stmt]) -> bool:
    """Whether an ``if`` body fails the test: ``pytest.fail(...)`` or ``raise AssertionError``."""
    for stmt in body:
        for n in ast.walk(stmt):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "fail":
                return True
            if isinstance(n, ast.Raise) and n.exc is not None and "AssertionError" in ast.unparse(n.exc):
                return True
    return False


def _hypothesis_deadlines(tree: ast.Module) -> list[tuple[str, int, str]]:
    """``settings(deadline=...)`` with a deadline other than None: hypothesis's wall-time assert."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "settings":
            for kw in node.keywords:
                if kw.arg == "deadline" and not (
                    isinstance(kw.value, ast.Constant) and kw.value.value is None
                ):
                    found.append(("settings", node.lineno, ast.unparse(node)[:120]))
    return found


def timed_asserts(source: str) -> list[tuple[str, int, str]]:
    """``(function, line, source)`` of every assertion on a duration in a test module's source (and
    every hypothesis deadline, reported as function ``settings``)."""
    tree = ast.parse(source)
    mod = _Module(tree)
    if not mod.reads_clock:
        return _hypothesis_deadlines(tree)
    tops = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        tops += [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    found = []
    for fn in tops:
        scope = mod.scope(fn)
        for node in ast.walk(fn):
            checked: ast.AST | None = None
            if isinstance(node, ast.Assert):
                checked = node.test
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr.startswith("assert")
            ):
                checked = node
            elif isinstance(node, ast.If) and _fails(node.body):
                checked = node.test
            if checked is not None and mod.is_duration(checked, scope):
                found.append((fn.name, node.lineno, ast.unparse(checked)[:120]))
    return found + _hypothesis_deadlines(tree)


# ---- the lint -------------------------------------------------------------------------------------
def test_no_test_asserts_on_wall_time_outside_the_allow_list():
    """Every test file: no duration assert but the allowed ones, and every allowed one still exists."""
    found: dict[str, list[str]] = {}
    for path in all_test_modules():
        where = path.relative_to(TESTS.parent).as_posix()  # the file's path in the checkout
        for fn, line, src in timed_asserts(path.read_text()):
            found.setdefault(f"{where}::{fn}", []).append(f"line {line}: {src}")
    unexpected = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not unexpected, (
        "tests assert on wall time (count, order or witness instead; or allow a >=10x bound in "
        f"ALLOWED with its reason): {unexpected}"
    )
    assert set(ALLOWED) <= set(found), f"allowed but gone (remove them): {set(ALLOWED) - set(found)}"


def test_hypothesis_has_no_wall_time_limits_in_this_suite():
    """The suite's hypothesis profile (tests/conftest.py) has no per-example deadline and no "too
    slow" health check: both time the shared machine (a JSON round trip test failed under load)."""
    from hypothesis import HealthCheck, settings

    assert settings.default.deadline is None
    assert HealthCheck.too_slow in settings.default.suppress_health_check


def _lint(src: str) -> list[str]:
    return [fn for fn, _, _ in timed_asserts(textwrap.dedent(src))]


def test_the_lint_finds_duration_asserts_however_they_are_written():
    """Direct, through variables, containers, comparisons, approx, helpers, ``from time import``,
    ``unittest`` style and ``if ...: pytest.fail``: each synthetic bad example is reported."""
    bad = """
        import time
        from time import perf_counter as pc

        import pytest


        def _took(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0


        def _stall_and_result(fn):
            t0 = time.monotonic()
            out = fn()
            return time.monotonic() - t0, out


        def test_direct():
            t0 = time.perf_counter()
            assert time.perf_counter() - t0 < 0.5


        def test_variable():
            t0 = time.monotonic()
            took = time.monotonic() - t0
            assert took < 1.0, took


        def test_comparison_feeding_an_assert():
            t0 = time.time()
            ok = time.time() - t0 < 2
            assert ok


        def test_container():
            stalls = []
            for _ in range(3):
                t0 = pc()
                stalls.append(pc() - t0)
            assert max(stalls) < 0.1


        def test_approx():
            start = time.perf_counter()
            waited = time.perf_counter() - start
            assert waited == pytest.approx(0.5, abs=0.2)


        def test_helper():
            assert 1.0 < _took(print) < 10


        def test_tuple_helper():
            stall, out = _stall_and_result(print)
            assert out is None
            assert stall < 0.05


        def test_arrival_times():
            arrivals = []
            t_start = time.perf_counter()
            for ev in range(3):
                arrivals.append((time.perf_counter(), ev))
            times = [t for t, _ in arrivals]
            assert times[-1] - times[0] > 0.2 * (arrivals[-1][0] - t_start)


        def test_if_fail():
            t0 = time.perf_counter()
            if time.perf_counter() - t0 > 1:
                pytest.fail("too slow")


        class TestStyle:
            def test_unittest(self):
                t0 = time.perf_counter()
                self.assertLess(time.perf_counter() - t0, 1.0)


        @settings(max_examples=10, deadline=500)
        @given(st.integers())
        def test_hypothesis_deadline(x):
            assert x == x
    """
    assert _lint(bad) == [
        "test_direct",
        "test_variable",
        "test_comparison_feeding_an_assert",
        "test_container",
        "test_approx",
        "test_helper",
        "test_tuple_helper",
        "test_arrival_times",
        "test_if_fail",
        "test_unittest",
        "settings",
    ]


def test_the_lint_leaves_polling_deadlines_and_untimed_asserts_alone():
    """Waiting for a condition with a generous deadline, timing only to print, a library's own
    timings and an Event's wait are no duration asserts."""
    good = """
        import time

        import pytest


        def test_polling_deadline(server):
            deadline = time.monotonic() + 10
            while server.cancelled() == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.cancelled() == 1


        def test_startup_deadline(proc):
            deadline = time.time() + 180
            while not proc.ready():
                if time.time() > deadline:
                    pytest.fail("server did not start in time")
                time.sleep(0.2)


        def test_printed_not_asserted(work):
            t0 = time.perf_counter()
            out = work()
            print(f"took {time.perf_counter() - t0:.2f} s")
            assert out == 3


        def test_library_timings(answer, event):
            assert 0 < answer.ttft_s <= answer.total_s
            assert event.wait(30)


        @settings(max_examples=30, deadline=None)
        @given(st.integers())
        def test_hypothesis_without_deadline(x):
            assert x == x
    """
    assert _lint(good) == []
