"""llama-index-retrievers-ragkv's classes are LlamaIndex's kinds under its namespace."""

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.node_parser import NodeParser
from llama_index.core.retrievers import BaseRetriever


def test_classes() -> None:
    from llama_index.retrievers.ragkv import (
        RagkvLlamaEmbedding,
        RagkvLlamaRetriever,
        RagkvNodeParser,
        RagkvQueryEngine,
    )

    for cls, base in (
        (RagkvLlamaRetriever, BaseRetriever),
        (RagkvQueryEngine, BaseQueryEngine),
        (RagkvLlamaEmbedding, BaseEmbedding),
        (RagkvNodeParser, NodeParser),
    ):
        assert issubclass(cls, base), (cls, base)
