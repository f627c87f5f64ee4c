"""Collections: named partitions of one index (documents, chunks, retrieval and the chunk KV a request
may reuse); this module is the one place a collection name is checked and a missing one resolved.

Every document belongs to exactly one collection (``DEFAULT_COLLECTION`` unless named); the same
document id may exist in several collections, each its own document. Stored chunk KV stays
content-addressed and shared (see :meth:`ragkv.rag.RAG.kv_visible` for why that shows a caller
nothing of another collection).
"""

from __future__ import annotations

import re

DEFAULT_COLLECTION = "default"
#: letters, digits, ``_ . -``; 1 to 64 characters
COLLECTION_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
_NAME = re.compile(COLLECTION_PATTERN)


class InvalidCollectionError(ValueError):
    """A collection name that is not 1-64 letters, digits, ``_``, ``.`` or ``-``."""


def collection_name(name: str | None = None) -> str:
    """``name`` checked, or :data:`DEFAULT_COLLECTION` when None (:class:`InvalidCollectionError`)."""
    if name is None:
        return DEFAULT_COLLECTION
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidCollectionError(
            f"invalid collection name {name!r}: 1-64 letters, digits, '_', '.' or '-'"
        )
    return name
