"""The exact KV tree's first level: a chunk's exact KV after a collection's prompt head.

Ingest precomputes it for every new chunk (docs/EXACT_REUSE.md, section 4), so the first retrieved chunk
of a request is an exact hit up to its last full page. One owner for both ingest paths: the
single-process :class:`ragkv.rag.RAG` (its chunk hook) and the Ray pipeline's workers
(:mod:`ragkv.rag.distributed`) call :func:`precompute_first_level`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ragkv.blend.exact import exact_prefill, exactness_check
from ragkv.blend.kvtree import KVTree, page_keys, tree_root
from ragkv.model.forward import exact_supported

#: what :func:`precompute_first_level` did with a chunk
COMPUTED, STORED, SKIPPED = "computed", "stored", "skipped"


def first_level_ids(head: Sequence[int], token_ids: Sequence[int]) -> list[int]:
    """The prompt the first level holds: the head, then the chunk."""
    return [int(t) for t in head] + [int(t) for t in token_ids]


def first_level_pages(model, tree: KVTree, head: Sequence[int], token_ids: Sequence[int]) -> list[str]:
    """The store keys of the first level's full pages (what a later request reads from the store)."""
    return [key for _, key in page_keys(tree_root(model), first_level_ids(head, token_ids), tree.page_tokens)]


def first_level_stored(model, tree: KVTree, head: Sequence[int], token_ids: Sequence[int]) -> bool:
    """Whether every full page of the chunk's first level is in the tree's store (False: no store, or
    no full page)."""
    if tree.store is None:
        return False
    keys = first_level_pages(model, tree, head, token_ids)
    return bool(keys) and all(tree.store.contains(k) for k in keys)


def precompute_first_level(model, tree: KVTree, head: Sequence[int], token_ids: Sequence[int]) -> str:
    """Compute the chunk's exact KV after ``head`` into ``tree`` (its pages queued for the store, waiting
    for room in the writer's queue): :data:`COMPUTED`; :data:`STORED` when every full page already is in
    the store (nothing computed: a re-run or a resumed run computes nothing twice); :data:`SKIPPED` where
    the model has no exact reuse here or head + chunk exceed its context."""
    if not exact_supported(model):
        return SKIPPED
    ids = first_level_ids(head, token_ids)
    if len(ids) > model.config.max_position or not exactness_check(model):
        return SKIPPED
    if first_level_stored(model, tree, head, token_ids):
        return STORED
    with torch.inference_mode():
        exact_prefill(model, ids, tree, boundaries=[len(head)], wait=True)
    return COMPUTED
