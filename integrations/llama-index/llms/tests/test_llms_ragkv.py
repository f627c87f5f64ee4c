"""llama-index-llms-ragkv is a LlamaIndex LLM under its namespace (as LlamaIndex's LLM packages check)."""

from llama_index.core.base.llms.base import BaseLLM


def test_llm_class() -> None:
    from llama_index.llms.ragkv import RagkvLlamaLLM

    assert BaseLLM.__name__ in [b.__name__ for b in RagkvLlamaLLM.__mro__]


def test_namespace_holds_only_the_llm() -> None:
    import llama_index.llms.ragkv as mod

    assert sorted(mod.__all__) == ["CHUNK_SEPARATOR", "RagkvLlamaLLM", "format_docs"]
