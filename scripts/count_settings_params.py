"""Count where a request's settings travel as loose names: the function signatures (and class fields)
of ragkv/, apps/ and integrations/ (their tests and examples aside) that take ``fidelity``, ``ratio``,
``mode`` or ``schedule``, outside the edge parsers named below (issue 55's measure).

The edge parsers are where loose input becomes a :class:`ragkv.RequestSettings` once: the service's
schemas and settings, the two CLIs, the framework options, the kv_transfer_params wire format, the
settings value itself, and the public Python entry points that take loose keywords (``LLM(...)``,
``LLM.generate``..., ``RAG(...)`` and the RAG's answer/stream methods, ``Engine.submit``'s request,
``ragkv.prefill``).
Everything else should pass the settings value or the planned ``BlendPlan``.

    python scripts/count_settings_params.py [-v]      # -v: list every place
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

NAMES = ("fidelity", "ratio", "mode", "schedule")
ROOTS = ("ragkv", "apps", "integrations")
#: whole files that parse outside input into the settings value (schemas, settings, CLIs)
EDGE_FILES = {
    "apps/ragkv_server/schemas.py",
    "apps/ragkv_server/config.py",
    "apps/ragkv_server/cli.py",
    "ragkv/cli.py",
}
#: ``file: qualified names`` of edge functions and classes (a class: its fields)
EDGE = {
    "ragkv/llm.py": {"LLM.__init__", "LLM.prefill", "LLM.generate", "LLM.stream", "LLM.operating_point"},
    "ragkv/rag/pipeline.py": {"RAG.__init__"},
    "ragkv/rag/answering.py": {
        "Answerer.answer_stream",
        "Answerer.stream_ids",
        "Answerer.stream_parts",
        "Answerer.stream_text",
    },
    "ragkv/engine/engine.py": {"Engine.make_request"},
    "ragkv/blend/prefill.py": {"prefill"},  # ``ragkv.prefill``: the public primitive
    "ragkv/fidelity/plan.py": {"RequestSettings"},
    "ragkv/remote/wire.py": {"BlendParams"},
    "integrations/frameworks/ragkv_frameworks/__init__.py": {"RagkvOptions"},
}


def places(root: Path = Path(".")) -> dict[str, list[tuple[str, str, bool, bool]]]:
    """name -> [(file:line, qualified name, is an edge parser, is a class field)] of every function
    signature or class field."""
    out: dict[str, list[tuple[str, str, bool]]] = {n: [] for n in NAMES}
    for top in ROOTS:
        for f in sorted((root / top).rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            if any(p in ("tests", "examples") for p in f.relative_to(root).parts):
                continue
            _walk(ast.parse(f.read_text()), rel, "", out)
    return out


def _walk(node: ast.AST, rel: str, prefix: str, out) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            qual = prefix + child.name
            a = child.args
            args = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
            for n in NAMES:
                if n in args:
                    out[n].append((f"{rel}:{child.lineno}", qual, _edge(rel, qual), False))
            _walk(child, rel, qual + ".", out)
        elif isinstance(child, ast.ClassDef):
            qual = prefix + child.name
            for st in child.body:
                if (
                    isinstance(st, ast.AnnAssign)
                    and isinstance(st.target, ast.Name)
                    and st.target.id in NAMES
                ):
                    out[st.target.id].append((f"{rel}:{st.lineno}", qual, _edge(rel, qual), True))
            _walk(child, rel, qual + ".", out)
        else:
            _walk(child, rel, prefix, out)


def _edge(rel: str, qual: str) -> bool:
    return rel in EDGE_FILES or qual in EDGE.get(rel, ()) or qual.split(".")[0] in EDGE.get(rel, ())


def counts(root: Path = Path("."), fields: bool = False) -> dict[str, int]:
    """Function signatures (and with ``fields`` class fields too) per name outside the edge parsers."""
    return {n: sum(not e and (fields or not f) for _, _, e, f in ps) for n, ps in places(root).items()}


def main() -> None:
    verbose = "-v" in sys.argv
    for n, ps in places().items():
        sigs = sum(not e and not f for _, _, e, f in ps)
        flds = sum(not e and f for _, _, e, f in ps)
        print(f"{n}: {sigs} signatures and {flds} class fields outside the edge parsers ({len(ps)} in all)")
        if verbose:
            for where, qual, edge, field in ps:
                kind = "edge " if edge else "field" if field else "     "
                print(f"    {kind} {where} {qual}")


if __name__ == "__main__":
    main()
