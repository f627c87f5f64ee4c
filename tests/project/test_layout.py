"""The layout holds: the card's top level (the core ``ragkv`` and its distributions: ``apps/`` and
``integrations/*``), imports inside ``ragkv`` run one way, and the library never reaches the edges.

kv <- attention <- model <- store <- blend <- llm <- engine <- rag <- integrations <- apps (docs/ARCHITECTURE.md, "The layers");
``defaults`` sits below them all; ``constrain`` (structured output) imports no other unit; ``fusion`` sits
on attention, ``generate`` and ``llm`` between blend and the engine. ``remote`` (the kv_transfer_params wire format
and the HTTP generator) and ``aio`` (the one thread-to-async bridge) are the core's because more than one edge uses them. Lazy imports inside functions
count too.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from ragkv.testing import build_wheel
from tests.helpers import REPO, source_files

#: rank of each ragkv subpackage / top-level module: a module may import only lower ranks
RANK = {
    "defaults": -1,
    "facts": -1,  # the invented-facts generator (the calibration set's and the adapter's data)
    "kv": -0.5,  # the chunk KV type and its key (computed by model.forward.compute_chunk_kv)
    "metrics": 0,
    "attention": 0,
    "constrain": 0,
    "aio": 0,  # the thread-to-async bridge (AnyIO only)
    "fusion": 1,
    "model": 1,
    "store": 3,
    "blend": 4,
    "prompt": 1.5,  # the prompt convention (chat templates of the model only)
    "generate": 5,
    "remote": 7.5,  # the kv_transfer_params wire format and the HTTP generator (a remote vLLM / ragkv-server)
    "fidelity": 5.5,  # the fidelity report and gate: on blend and generate, below every surface
    "adapter": 5.7,  # KV adapters: the file, applying one (prefill takes it duck-typed), training one
    "llm": 6,
    "engine": 6.5,  # continuous batching over an LLM's model, planner, chunk resolver and KV tree
    "rag": 7,
    "demo": 8,
    "__init__": 9,
    "testing": 9.5,  # what the test suites share (ragkv's and its distributions'): fixtures, the tiny model
    "cli": 10,  # what the core owns: demo, models, calibrate, adapter, eval (a checkout's, in a child process)
}
#: what the installed core never imports: a checkout's folders and the distributions built on it
EDGES = (
    "eval",
    "tests",
    "ragkv_server",
    "ragkv_frameworks",
    "langchain_ragkv",
    "llama_index.llms.ragkv",
    "llama_index.retrievers.ragkv",
    "ragkv_vllm",
)
#: the card's top level: the core package, its distributions, the checkout's folders
TOP_LEVEL = {"pyproject.toml", "README.md", "ragkv", "integrations", "apps", "tests", "eval"}
#: folders of ``tests/unit/`` that are no ragkv unit: the checkout's evaluation harness (eval/)
UNIT_TESTS_BEYOND_RAGKV = {"eval"}
#: each distribution of the repository: folder -> (name, its importable package folder)
DISTRIBUTIONS = {
    "apps": ("ragkv-server", "ragkv_server"),
    "integrations/frameworks": ("ragkv-frameworks", "ragkv_frameworks"),
    "integrations/langchain": ("langchain-ragkv", "langchain_ragkv"),
    "integrations/llama-index/llms": ("llama-index-llms-ragkv", "llama_index/llms/ragkv"),
    "integrations/llama-index/retrievers": ("llama-index-retrievers-ragkv", "llama_index/retrievers/ragkv"),
    "integrations/vllm": ("ragkv-vllm", "ragkv_vllm"),
}


def _imports(path: Path) -> set[str]:
    """Absolute module names imported anywhere in ``path`` (top level or inside functions)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _is_edge(module: str) -> bool:
    return any(module == e or module.startswith(e + ".") for e in EDGES)


def _unit(path: Path, root: Path) -> str:
    rel = path.relative_to(root).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def test_imports_inside_ragkv_run_one_way():
    root = REPO / "ragkv"
    bad = []
    for f in source_files(root):
        src = _unit(f, root)
        assert src in RANK, f"new ragkv unit {src!r}: rank it here and in docs/ARCHITECTURE.md"
        for mod in _imports(f):
            parts = mod.split(".")
            if parts[0] == "ragkv" and len(parts) > 1 and parts[1] != src:
                if RANK[parts[1]] >= RANK[src]:
                    bad.append(f"{f.relative_to(REPO)} imports {mod}")
            elif _is_edge(mod):
                bad.append(f"{f.relative_to(REPO)} imports the edge {mod}")
    assert not bad, "\n".join(bad)


#: the most floors of imports inside ragkv (a unit stands one floor above the highest unit it imports);
#: with the distributions and eval/ above it, a reader climbs at most 10 (issue 55)
MAX_FLOORS = 8


def floors(root: Path) -> dict[str, int]:
    """Each ragkv unit's floor: 1 + the highest floor among the units it imports (lazy imports too)."""
    deps: dict[str, set[str]] = {}
    for f in source_files(root):
        src = _unit(f, root)
        for mod in _imports(f):
            parts = mod.split(".")
            if parts[0] == "ragkv" and len(parts) > 1 and parts[1] != src and parts[1] in RANK:
                deps.setdefault(src, set()).add(parts[1])
            elif mod == "ragkv" and src != "__init__":
                deps.setdefault(src, set()).add("__init__")
    memo: dict[str, int] = {}

    def floor(u: str) -> int:
        if u not in memo:
            memo[u] = 1 + max((floor(d) for d in deps.get(u, ())), default=0)
        return memo[u]

    return {u: floor(u) for u in {_unit(f, root) for f in source_files(root)}}


def test_the_core_has_at_most_8_floors_of_imports():
    fl = floors(REPO / "ragkv")
    top = max(fl.values())
    assert top <= MAX_FLOORS, f"{top} floors: " + ", ".join(
        f"{u} {n}" for u, n in sorted(fl.items(), key=lambda x: -x[1])
    )


def test_nothing_in_ragkv_imports_eval_or_edits_sys_path():
    """``ragkv`` never imports a checkout's ``eval`` (``ragkv eval`` runs it as a child process) nor
    reaches one through ``sys.path`` (the CLI used to insert the checkout's root to import eval.run)."""
    bad = []
    for f in source_files("ragkv"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path":
                if isinstance(node.value, ast.Name) and node.value.id == "sys":
                    bad.append(f"{f.relative_to(REPO)}:{node.lineno} uses sys.path")
        bad += [
            f"{f.relative_to(REPO)} imports {m}" for m in _imports(f) if m == "eval" or m.startswith("eval.")
        ]
    assert not bad, "\n".join(bad)


def test_eval_never_imports_the_tests():
    """The benchmarks and the evaluation take what they share with the tests from the library (e.g.
    ``ragkv.model.loader.hf_state_dict``), never from a test module: tests import eval, not back."""
    bad = [
        f"{f.relative_to(REPO)} imports {m}"
        for f in source_files("eval")
        for m in _imports(f)
        if m == "tests" or m.startswith("tests.")
    ]
    assert not bad, "\n".join(bad)


def test_the_top_level_is_the_cards():
    """The checkout's top level is the design card's: pyproject.toml, ragkv, integrations, apps, tests,
    eval, README.md (plus the data and tooling folders), and each distribution has its own pyproject,
    README, package and tests."""
    top = {p.name for p in REPO.iterdir() if not p.name.startswith(".")}
    assert TOP_LEVEL <= top, sorted(TOP_LEVEL - top)
    for folder, (name, package) in DISTRIBUTIONS.items():
        root = REPO / folder
        meta = tomllib.loads((root / "pyproject.toml").read_text())["project"]
        assert meta["name"] == name, folder
        assert any(d.startswith("ragkv") and not d.startswith("ragkv-") for d in meta["dependencies"]), name
        assert (root / "README.md").is_file(), folder
        assert source_files(root / package), folder
        assert source_files(root / "tests"), folder
    assert source_files("integrations/langchain/tests/unit_tests")
    assert source_files("integrations/langchain/tests/integration_tests")
    testpaths = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
        "testpaths"
    ]
    assert set(testpaths) == {"tests", *(f"{d}/tests" for d in DISTRIBUTIONS)}, testpaths


def _scratch(rel: Path) -> bool:
    """A folder tools leave beside tests (``__pycache__``, ``.pytest_cache``, ``.hypothesis``...)."""
    return any(part == "__pycache__" or part.startswith(".") for part in rel.parts)


def test_the_core_tests_mirror_the_packages():
    """tests/ mirrors ragkv/ (issue 40): every subpackage of ragkv (a folder with ``__init__.py``) has
    test files in ``tests/unit/<package>/``, every folder of ``tests/unit/`` names a unit of ragkv (a subpackage or top-level module of ``RANK``) or eval,
    ``tests/e2e/`` and ``tests/project/`` hold tests, no test file sits at ``tests/``'s top level (the
    root conftest.py and the shared helpers do), and every test folder is a package (so basenames may
    repeat). A missing folder fails here, rather than checking nothing."""
    tests = REPO / "tests"
    source_files("ragkv")  # the walked folders exist
    for folder in ("unit", "e2e", "project"):
        source_files(tests / folder)
    packages = sorted(p.parent.name for p in (REPO / "ragkv").glob("*/__init__.py"))
    assert packages, packages
    missing = [p for p in packages if not any((tests / "unit" / p).glob("test_*.py"))]
    assert not missing, f"ragkv subpackages with no tests/unit/<package>/test_*.py: {missing}"
    units = {d.name for d in (tests / "unit").iterdir() if d.is_dir() and not _scratch(Path(d.name))}
    strays = sorted(units - set(RANK) - UNIT_TESTS_BEYOND_RAGKV)
    assert not strays, f"tests/unit/ folders that name no ragkv unit: {strays}"
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert not top, (
        f"test files at tests/'s top level (file them under unit/<package>, e2e or project): {top}"
    )
    folders = [tests, *(d for d in tests.rglob("*") if d.is_dir() and not _scratch(d.relative_to(tests)))]
    bare = [d.relative_to(REPO).as_posix() for d in folders if not (d / "__init__.py").is_file()]
    assert not bare, f"test folders without __init__.py: {bare}"


def test_the_edges_use_the_library_not_each_others_internals():
    """eval never imports the service's app (it starts it as a process), nor the integrations but in the
    harness that drives them (eval/standard_paths.py, run as a child by bench_flat_reuse); the
    distributions reach each other only through their public packages."""
    bad = []
    integrations = ("langchain_ragkv", "llama_index.llms.ragkv", "llama_index.retrievers.ragkv", "ragkv_vllm")
    for f in source_files("eval"):
        banned = ("ragkv_server.server",)
        if f.name != "standard_paths.py":
            banned += integrations
        bad += [f"{f.relative_to(REPO)} imports {m}" for m in _imports(f) if m.startswith(banned)]
    assert not bad, "\n".join(bad)


def test_the_suites_stand_alone():
    """Issue 55: the core's tests import no distribution (a feature seen through the service or a wrapper
    is tested in that distribution), and a distribution's tests import neither the core's ``tests`` nor
    the checkout's ``eval`` (what every suite shares is ``ragkv.testing``), so ``cd <folder> && pytest``
    runs them. A test that drives the checkout's harness asks for it by name (``pytest.importorskip``)."""
    distributions = tuple(EDGES[2:])
    bad = [
        f"{f.relative_to(REPO)} imports {m}"
        for f in source_files("tests")
        for m in _imports(f)
        if m.startswith(distributions)
    ]
    for folder in DISTRIBUTIONS:
        bad += [
            f"{f.relative_to(REPO)} imports {m}"
            for f in source_files(REPO / folder / "tests")
            for m in _imports(f)
            if m.split(".")[0] in ("tests", "eval")
        ]
    assert not bad, "\n".join(bad)


def test_only_the_vllm_distribution_declares_the_vllm_plugin():
    """``pip install ragkv`` hooks nothing in vLLM: the ``vllm.general_plugins`` entry point is ragkv-vllm's."""
    declared = {}
    for folder in (".", *DISTRIBUTIONS):
        meta = tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]
        declared[meta["name"]] = meta.get("entry-points", {}).get("vllm.general_plugins")
    assert declared.pop("ragkv-vllm") == {"ragkv": "ragkv_vllm.plugin:register"}
    assert not any(declared.values()), declared


@pytest.mark.slow
def test_the_built_core_wheel_ships_only_ragkv_and_registers_no_vllm_plugin(tmp_path):
    """Installing ragkv adds one top-level package and no vLLM plugin: the service and the integrations are
    distributions of their own (issue 24: a wheel used to add top-level ``apps``, ``integrations`` and
    ``eval``; issue 40: it used to register ``vllm.general_plugins``, so every vLLM process loaded it)."""
    src = tmp_path / "core"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "ragkv", src / "ragkv", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    names, entry_points = build_wheel(src, tmp_path / "build")
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"ragkv"}, sorted(top)
    assert "ragkv/demo/corpus.json" in names and "ragkv/aio.py" in names
    assert not any(n.startswith(("ragkv/apps/server", "ragkv/integrations/vllm/")) for n in names)
    # the fidelity gate's data: the calibration set and every shipped report (the default model's)
    shipped = [p.relative_to(REPO).as_posix() for p in (REPO / "ragkv/fidelity/reports").glob("*.json")]
    assert shipped and {"ragkv/fidelity/calibration_set.json", *shipped} <= set(names)
    # the shipped KV adapters and their manifest (failed before the package-data line)
    adapters = [p.relative_to(REPO).as_posix() for p in (REPO / "ragkv/adapter/shipped").iterdir()]
    assert "ragkv/adapter/shipped/manifest.json" in adapters and set(adapters) <= set(names)
    assert "[console_scripts]" in entry_points and "vllm.general_plugins" not in entry_points, entry_points


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
