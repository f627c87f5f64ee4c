"""The package layout holds: imports inside ``ragkv`` run one way, and the library never reaches the edges.

attention <- model <- kv <- store <- blend <- engine <- rag (README, "Layout"); ``defaults`` sits
below them all; ``constrain`` (structured output) imports no other unit; ``fusion`` sits on attention, ``generate`` and ``llm`` between blend and rag. Lazy imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

#: rank of each ragkv subpackage / top-level module: a module may import only lower ranks
RANK = {
    "defaults": -1,
    "metrics": 0,
    "attention": 0,
    "constrain": 0,
    "fusion": 1,
    "model": 1,
    "kv": 2,
    "store": 3,
    "blend": 4,
    "generate": 5,
    "llm": 6,
    "engine": 6,
    "rag": 7,
    "demo": 8,
    "cli": 9,
    "__init__": 9,
}
EDGES = ("apps", "integrations", "eval")


def _imports(path: Path) -> set[str]:
    """Absolute module names imported anywhere in ``path`` (top level or inside functions)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _unit(path: Path, root: Path) -> str:
    rel = path.relative_to(root).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def test_imports_inside_ragkv_run_one_way():
    root = REPO / "ragkv"
    bad = []
    for f in sorted(root.rglob("*.py")):
        src = _unit(f, root)
        assert src in RANK, f"new ragkv unit {src!r}: give it a rank in this test and the README layout"
        for mod in _imports(f):
            parts = mod.split(".")
            if parts[0] == "ragkv" and len(parts) > 1 and parts[1] != src:
                if RANK[parts[1]] >= RANK[src]:
                    bad.append(f"{f.relative_to(REPO)} imports {mod}")
            elif parts[0] in EDGES and src != "cli":  # the CLI launches the server and the evaluation
                bad.append(f"{f.relative_to(REPO)} imports the edge {mod}")
    assert not bad, "\n".join(bad)


def test_the_edges_use_the_library_not_each_others_internals():
    """eval never imports apps or integrations; integrations never import apps."""
    bad = []
    for edge, banned in (("eval", ("apps.server", "integrations")), ("integrations", ("apps",))):
        for f in sorted((REPO / edge).rglob("*.py")):
            bad += [f"{f.relative_to(REPO)} imports {m}" for m in _imports(f) if m.startswith(banned)]
    assert not bad, "\n".join(bad)
