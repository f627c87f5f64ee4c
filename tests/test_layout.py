"""The package layout holds: imports inside ``ragkv`` run one way, and the library never reaches the edges.

attention <- model <- kv <- store <- blend <- engine <- rag <- integrations <- apps (docs/ARCHITECTURE.md, "The layers");
``defaults`` sits below them all; ``constrain`` (structured output) imports no other unit; ``fusion`` sits on attention, ``generate`` and ``llm`` between blend and rag. Lazy imports inside functions count too.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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
    "prompt": 1.5,  # the prompt convention (chat templates of the model only)
    "generate": 5,
    "fidelity": 5.5,  # the fidelity report and gate: on blend and generate, below every surface
    "adapter": 5.7,  # KV adapters: the file, applying one (prefill takes it duck-typed), training one
    "llm": 6,
    "engine": 6,
    "rag": 7,
    "demo": 8,
    "__init__": 9,
    "integrations": 10,  # LangChain, LlamaIndex, vLLM: on top of the library's public units
    "apps": 11,  # the service (it may use the vLLM client of the integrations)
    "cli": 12,  # launches the service (and a checkout's eval)
}
#: top-level folders of a checkout that the installed package never imports (the CLI's ``eval`` aside)
EDGES = ("eval", "tests")


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
        assert src in RANK, f"new ragkv unit {src!r}: rank it here and in docs/ARCHITECTURE.md"
        for mod in _imports(f):
            parts = mod.split(".")
            if parts[0] == "ragkv" and len(parts) > 1 and parts[1] != src:
                if RANK[parts[1]] >= RANK[src]:
                    bad.append(f"{f.relative_to(REPO)} imports {mod}")
            elif parts[0] in EDGES and src != "cli":  # the CLI launches the server and the evaluation
                bad.append(f"{f.relative_to(REPO)} imports the edge {mod}")
    assert not bad, "\n".join(bad)


def test_the_edges_use_the_library_not_each_others_internals():
    """eval never imports the service's app or the integrations (it starts them as processes)."""
    bad = []
    for edge, banned in (("eval", ("ragkv.apps.server", "ragkv.integrations")),):
        for f in sorted((REPO / edge).rglob("*.py")):
            bad += [f"{f.relative_to(REPO)} imports {m}" for m in _imports(f) if m.startswith(banned)]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_the_built_wheel_ships_only_the_ragkv_package(tmp_path):
    """Installing ragkv adds one top-level package: the service and the integrations are ``ragkv.apps`` and
    ``ragkv.integrations``, and the vLLM plugin's entry point names them so (issue 24: a wheel used to add
    top-level ``apps``, ``integrations`` and ``eval``)."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("ragkv", "eval", "tests", "ragkv_data/demo"):  # ragkv_data: the default data folder
        (src / name).mkdir(parents=True)
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=ignore, dirs_exist_ok=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    out = tmp_path / "wheel"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(out),
        ".",
    ]
    subprocess.run(cmd, cwd=src, check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("ragkv-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"ragkv"}, sorted(top)
    for module in ("ragkv/apps/server.py", "ragkv/integrations/vllm/plugin.py", "ragkv/demo/corpus.json"):
        assert module in names
    # the fidelity gate's data: the calibration set and every shipped report (the default model's)
    shipped = [p.relative_to(REPO).as_posix() for p in (REPO / "ragkv/fidelity/reports").glob("*.json")]
    assert shipped and {"ragkv/fidelity/calibration_set.json", *shipped} <= set(names)
    assert "ragkv = ragkv.integrations.vllm.plugin:register" in entry_points


def test_ragkv_eval_finds_the_checkouts_harness_from_another_directory(tmp_path):
    """``ragkv eval`` runs the checkout's eval/ (not installed) from any working directory."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "from ragkv.cli import main; main(['eval', '--help'])"
    # ragkv as installed (editable: this checkout's); the working directory holds no eval/
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage:") and "--dataset" in r.stdout
