"""The old import paths (``ragkv.integrations.*``, ``ragkv.apps.*``) still work for one release, with a
DeprecationWarning, as the distributions' modules; a missing distribution says what to install."""

from __future__ import annotations

import importlib
import sys

import pytest


@pytest.fixture
def fresh(monkeypatch):
    """Forget the old names (and ``ragkv_vllm``) so each import runs the alias again."""
    for name in list(sys.modules):
        if name.startswith(("ragkv.integrations.", "ragkv.apps.")):
            monkeypatch.delitem(sys.modules, name)
    return monkeypatch


def test_the_core_parts_keep_their_old_names(fresh):
    with pytest.warns(DeprecationWarning, match="ragkv.remote.client"):
        old = importlib.import_module("ragkv.integrations.vllm.client")
    assert old is importlib.import_module("ragkv.remote.client")
    with pytest.warns(DeprecationWarning, match="ragkv.frameworks"):
        from ragkv.integrations.common import fold_messages
    from ragkv.frameworks import fold_messages as new

    assert fold_messages is new


def test_the_distributions_keep_their_old_names(fresh):
    pytest.importorskip("langchain_ragkv")
    pytest.importorskip("llama_index.retrievers.ragkv")
    pytest.importorskip("ragkv_server")
    from llama_index.llms.ragkv import RagkvLlamaLLM
    from llama_index.retrievers.ragkv import RagkvQueryEngine

    import langchain_ragkv
    import ragkv_server.config

    with pytest.warns(DeprecationWarning, match="langchain-ragkv"):
        from ragkv.integrations.langchain import ChatRagkv
    assert ChatRagkv is langchain_ragkv.ChatRagkv
    with pytest.warns(DeprecationWarning):
        from ragkv.integrations.llama_index import RagkvLlamaLLM as old_llm
        from ragkv.integrations.llama_index import RagkvQueryEngine as old_engine
        from ragkv.integrations.llama_index.query_engine import RagkvQueryEngine as old_engine_too
    assert old_llm is RagkvLlamaLLM and old_engine is RagkvQueryEngine is old_engine_too
    with pytest.warns(DeprecationWarning, match="ragkv-server"):
        from ragkv.apps import config
    assert config is ragkv_server.config


def test_a_missing_distribution_names_what_to_install(fresh):
    fresh.setitem(sys.modules, "ragkv_vllm", None)  # as if ragkv-vllm were not installed
    with pytest.warns(DeprecationWarning), pytest.raises(ModuleNotFoundError, match="pip install ragkv-vllm"):
        importlib.import_module("ragkv.integrations.vllm.plugin")
    with pytest.raises(ModuleNotFoundError, match="eval/standard_paths.py"):
        importlib.import_module("ragkv.integrations.standard_paths")


def test_ragkv_serve_without_the_server_says_how_to_install_it(monkeypatch):
    from ragkv import cli

    monkeypatch.setitem(sys.modules, "ragkv_server", None)
    monkeypatch.delitem(sys.modules, "ragkv_server.server", raising=False)
    with pytest.raises(SystemExit, match="pip install ragkv-server"):
        cli.main(["serve", "--help"])
