"""One owner per concept in the core (issue 40): lints over the source, no model loaded.

* no import circle between any two modules of ``ragkv/`` (every module, imports inside functions too);
* one chunk-KV resolver, one span planner, one prompt splitter, one prompt renderer, one blend plan,
  and thread-to-async bridges only where listed.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

ROOT = REPO / "ragkv"
#: moving out to their own distributions (issue 40): not walked by the import-circle test
LEAVING = ("integrations", "apps")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package) of every module under ``ragkv/`` but the leaving folders."""
    out = {}
    for f in sorted(ROOT.rglob("*.py")):
        parts = list(f.relative_to(REPO).with_suffix("").parts)
        if len(parts) > 2 and parts[1] in LEAVING:
            continue
        pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if pkg else parts)] = (f, pkg)
    return out


def _import_graph() -> dict[str, dict[str, int]]:
    """Module -> {imported ragkv module: line}; ``from pkg import sub`` counts as importing ``pkg.sub``."""
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for mod, (path, pkg) in mods.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = mod if pkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        here = here.rpartition(".")[0]
                    base = f"{here}.{base}" if base else here
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for name in names:
                target = owner(name) if name.startswith("ragkv") else None
                if target is not None and target != mod:
                    edges.setdefault(target, node.lineno)
        graph[mod] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle_between_any_two_modules():
    """Every module of ``ragkv/`` (not only subpackages), imports inside functions included: a circle
    broken by a lazy import is still a circle."""
    graph = _import_graph()
    assert len(graph) > 100 and "ragkv.rag.pipeline" in graph and "ragkv.blend.gate" in graph
    bad = []
    for comp in _cycles(graph):
        inner = [f"{a} -> {b} (line {n})" for a in comp for b, n in graph[a].items() if b in comp]
        bad.append(" / ".join(comp) + ":\n  " + "\n  ".join(inner))
    assert not bad, "\n".join(bad)


def test_the_cycle_finder_finds_a_circle():
    """The finder itself: a two-module circle and a three-module one are found, a chain is not."""
    graph = {"a": {"b": 1}, "b": {"a": 2}, "c": {"d": 1}, "d": {"e": 1}, "e": {"c": 1}, "f": {"a": 1}}
    assert sorted(_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []


# ---- one owner per concept ------------------------------------------------------------------------------
def _calls(names: set[str]) -> list[tuple[str, int, str]]:
    """``(file, line, name)`` of every call of a function named in ``names`` anywhere under ``ragkv/``."""
    out = []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(REPO).as_posix()
        out += [(rel, n, name) for n, name in _calls_in(ast.parse(f.read_text())) if name in names]
    return out


def _defs(name: str) -> list[str]:
    """Files under ``ragkv/`` that define a function or class named ``name``."""
    out = []
    for f in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
                out.append(f.relative_to(REPO).as_posix())
    return out


def _method_calls(path: str, cls: str, method: str) -> set[str]:
    """Names called in ``cls.method`` of ``path``."""
    for node in ast.walk(ast.parse((REPO / path).read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == method:
                    return {c for _, c in _calls_in(fn)}
    raise AssertionError(f"{path}: {cls}.{method} not found")


def _calls_in(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, called name)`` of every call in ``tree``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            out.append((node.lineno, name))
    return out


def test_one_chunk_kv_resolver_everywhere_under_ragkv():
    """The one-resolver lint of tests/unit/blend/test_resolver.py over every file under ``ragkv/`` (its edge
    folders included wherever they live)."""
    from tests.unit.blend.test_resolver import KV_READERS

    bad = [
        f"{f}:{n} {name}" for f, n, name in _calls({"compute_chunk_kv", "StoredChunk"}) if f not in KV_READERS
    ]
    assert not bad, bad


def test_one_span_planner():
    """Which references of a request are reused and where: only ``ragkv.blend.spans`` searches a
    prompt for referenced chunks (:func:`plan_spans`); the service and the vLLM connector call it
    (``check_spans`` stays free to use: it validates spans a planner made)."""
    owner = "ragkv/blend/spans.py"
    bad = [f"{f}:{n} {c}" for f, n, c in _calls({"locate_chunks", "find_occurrences"}) if f != owner]
    assert not bad, bad
    assert _defs("plan_spans") == [owner]
    # the vLLM connector (its own distribution) plans its spans with the core's planner
    assert "plan_spans" in _method_calls(
        "integrations/vllm/ragkv_vllm/connector.py", "RagkvConnector", "_find_chunks"
    )


def test_one_prompt_splitter_and_one_prompt_renderer():
    """A prompt is split around its chunks by ``split_at_chunks`` only (a job's parts and the resolver's
    pieces both call it), and rendered around them by one renderer (``render_parts``, beside the chat template
    it applies in ``ragkv/model/chat.py``; the prompt convention in ``ragkv.prompt`` calls it)."""
    assert _defs("split_at_chunks") == ["ragkv/blend/locate.py"]
    assert "split_at_chunks" in _method_calls("ragkv/rag/generation.py", "PromptJob", "parts")
    assert "split_at_chunks" in _method_calls("ragkv/blend/resolver.py", "ChunkResolver", "pieces")
    bad = [f"{f}:{n}" for f, n, _ in _calls({"chat_parts"}) if f != "ragkv/model/chat.py"]
    assert not bad, bad
    assert _defs("render_parts") == ["ragkv/model/chat.py"]
    assert "ragkv/prompt.py" in {f for f, _, _ in _calls({"render_parts"})}
    assert "tokenize_parts" in _method_calls("ragkv/llm.py", "LLM", "tokenize_prompt")


def test_one_blend_plan():
    """A request's mode, ratio, schedule and fidelity become one ``BlendPlan`` in one function, and
    the default ratio has one home."""
    assert _defs("BlendPlan") == ["ragkv/blend/plan.py"]
    assert _defs("plan_blend") == ["ragkv/fidelity/plan.py"]
    homes = []
    for f in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "DEFAULT_RATIO" for t in node.targets
            ):
                homes.append(f.relative_to(REPO).as_posix())
    assert homes == ["ragkv/defaults.py"]
    callers = {f for f, _, _ in _calls({"plan_blend"})}
    assert callers == {"ragkv/fidelity/plan.py"}, callers  # Planner.plan: every owner plans through one
    assert "plan_blend" in _method_calls("ragkv/fidelity/plan.py", "Planner", "plan")
    assert not _calls({"choose_ratio"}) or {f for f, _, _ in _calls({"choose_ratio"})} == {
        "ragkv/rag/answering.py"
    }, "only the answering side asks the loading controller (no generator calls back into the RAG)"


#: where a thread hands items to an event loop by hand (``call_soon_threadsafe``): only the core's one
#: bridge (``ragkv/aio.py``), which the service, the framework integrations and asyncio readers of
#: an engine handle's stream all use
BRIDGES = {"ragkv/aio.py"}


def test_thread_to_async_bridges_only_where_listed():
    """No hand-written bridge in the core, the service or the integrations (their tests aside)."""
    calls = _calls({"call_soon_threadsafe"})
    for top in ("apps", "integrations"):
        for f in sorted((REPO / top).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            if "/tests/" not in rel:
                calls += [
                    (rel, n, c) for n, c in _calls_in(ast.parse(f.read_text())) if c == "call_soon_threadsafe"
                ]
    bad = [f"{f}:{n}" for f, n, _ in calls if f not in BRIDGES]
    assert not bad, f"a new hand-written thread-to-async bridge: use the core's ({sorted(BRIDGES)})\n{bad}"


def test_request_settings_travel_as_one_value_below_the_edge():
    """Issue 55: a request's ``fidelity``, ``ratio``, ``mode`` and ``schedule`` are parsed once at the
    edge into a ``RequestSettings``; below it at most 8 function signatures each take the loose name
    (the count of ``scripts/count_settings_params.py``): the planned ``BlendPlan``, the settings value
    or a fidelity ``ReportKey`` travels instead; a ``schedule`` is left only where the blend itself
    runs one (the prefill, the question pass, adapter training, the calibration ladder)."""
    import runpy

    counts = runpy.run_path(str(REPO / "scripts" / "count_settings_params.py"))["counts"](REPO)
    assert all(counts[n] <= 8 for n in ("fidelity", "ratio", "mode", "schedule")), counts


def test_one_definition_of_the_prefill_modes():
    """The four mode names are listed once (``ragkv.defaults.Mode``): no tuple, list or ``Literal`` of
    them anywhere else in the core, the service or the integrations."""
    from ragkv.defaults import MODES

    names = set(MODES)
    bad = []
    for top in ("ragkv", "apps", "integrations"):
        for f in sorted((REPO / top).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            if "/tests/" in rel or rel == "ragkv/defaults.py":
                continue
            for node in ast.walk(ast.parse(f.read_text())):
                elts = node.elts if isinstance(node, ast.Tuple | ast.List) else None
                if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple):
                    elts = node.slice.elts
                if elts and {e.value for e in elts if isinstance(e, ast.Constant)} >= names:
                    bad.append(f"{rel}:{node.lineno}")
    assert not bad, bad
