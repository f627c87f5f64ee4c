"""The package's public names, as LangChain's partner packages check them."""

import langchain_ragkv

EXPECTED_ALL = [
    "CHUNK_SEPARATOR",
    "ChatRagkv",
    "RagkvEmbeddings",
    "RagkvLLM",
    "RagkvRetriever",
    "RagkvTextSplitter",
    "format_docs",
    "rag_chain",
    "split_prompt",
    "to_document",
]


def test_all_imports() -> None:
    assert sorted(langchain_ragkv.__all__) == sorted(EXPECTED_ALL)
    assert all(hasattr(langchain_ragkv, name) for name in EXPECTED_ALL)
