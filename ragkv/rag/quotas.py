"""Quotas: what one ingest may add, per document and per collection, checked before anything is written.

Three limits (:class:`Quotas`), each ``None`` for no limit:

* ``max_document_tokens``: a document's tokens (the sum of its chunks' token counts, as split by the
  RAG: with ``overlap``, overlapping tokens count in each chunk, as they are computed and stored);
* ``max_collection_tokens``: the tokens of every chunk of a collection;
* ``max_collection_kv_bytes``: the stored chunk KV a collection accounts for: the tokens of its
  *distinct* chunk KV keys (a blob two of its chunks share counts once; a blob shared with another
  collection counts in both, as each would need it alone) times ``kv_bytes_per_token``.

``kv_bytes_per_token`` is declared, or measured once (:func:`measure_kv_bytes_per_token`): the size of
the store codec's blob of a fixed sample text's KV at the RAG's chunk size, per token, rounded up.
For fixed-width codecs (``raw``, ``int8``, ``int4``) that is what a full chunk takes; for entropy-coded
ones (``stepz``, the default) real chunks vary around it by a few percent. The accounting is an
estimate by design: it is known *before* any KV is computed, so an ingest that would go over a limit
is refused before it writes anything, and it does not move when KV is evicted, recomputed or written
back later. What the store really holds is bounded by its own byte cap (``max_bytes``).

An ingest is checked as a whole (:meth:`ragkv.rag.RAG.ingest`): every changed document is split first,
then each is held to ``max_document_tokens`` and the collection as it would be after the commit (a
replaced document's old chunks leave, its new ones arrive: a replacement counts once) to the
collection limits; one refusal refuses the whole call and nothing of it is written (no chunk, no KV,
no write-ahead record). A collection limit refuses only ingests that raise the collection's usage
above it: one already over a lowered limit may still shrink (a smaller replacement; deletes always).
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass

#: default per-document bound: ~500,000 characters of English (a long book) on common tokenizers;
#: on the default model ~0.45 GB of stored ``stepz`` KV (~3.5 KB/token), ~6 GB as raw fp32 (~46 KB/token)
DEFAULT_MAX_DOCUMENT_TOKENS = 131_072

#: limit name -> HTTP status of its refusal (a document too large: 413; a collection full: 429)
STATUS = {"max_document_tokens": 413, "max_collection_tokens": 429, "max_collection_kv_bytes": 429}


@dataclass(frozen=True)
class Quotas:
    """Ingest limits (``None``: unlimited). Collection limits default to unlimited: a collection's KV is
    already bounded by the store's byte cap (20 GiB for the default store), and how a store is shared
    between collections is a deployment's policy, not something one default fits."""

    max_document_tokens: int | None = DEFAULT_MAX_DOCUMENT_TOKENS
    max_collection_tokens: int | None = None
    max_collection_kv_bytes: int | None = None
    #: stored KV bytes accounted per chunk token; None: measured (:func:`measure_kv_bytes_per_token`)
    kv_bytes_per_token: int | None = None

    def __post_init__(self):
        for name, v in asdict(self).items():
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"quota {name} must be a positive integer or None, got {v!r}")

    @property
    def limits_collections(self) -> bool:
        return self.max_collection_tokens is not None or self.max_collection_kv_bytes is not None

    def limits(self) -> dict:
        return {name: v for name, v in asdict(self).items() if name.startswith("max_")}


@dataclass(frozen=True)
class Usage:
    """What a collection holds, as the quotas count it."""

    collection: str
    documents: int
    chunks: int
    #: tokens of every chunk
    tokens: int
    #: tokens of the collection's distinct chunk KV keys
    kv_tokens: int
    kv_bytes_per_token: int

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token


class QuotaExceededError(ValueError):
    """An ingest refused by a quota before anything of it was written (:data:`STATUS`: 413 for a
    document over ``max_document_tokens``, 429 for a collection that would go over its limits)."""

    def __init__(
        self,
        limit: str,
        value: int,
        usage: int | None,
        requested: int,
        collection: str,
        document: str | None = None,
    ):
        self.limit, self.value, self.usage, self.requested = limit, value, usage, requested
        self.collection, self.document = collection, document
        self.status = STATUS[limit]
        if limit == "max_document_tokens":
            self.usage = None  # a document's own size: no usage to speak of
            msg = f"document {document!r} has {requested:,} tokens, more than max_document_tokens ({value:,})"
        else:
            what = "tokens" if limit == "max_collection_tokens" else "bytes of stored KV"
            msg = (
                f"collection {collection!r} would hold {requested:,} {what} after this ingest "
                f"(now {usage:,}), more than {limit} ({value:,})"
            )
        super().__init__(f"quota exceeded: {msg}; nothing of this request was ingested")

    def details(self) -> dict:
        """The refusal as data: which limit, its value, the current usage and what the ingest asked for."""
        out = {"limit": self.limit, "limit_value": self.value, "requested": self.requested}
        if self.usage is not None:
            out["usage"] = self.usage
        out["collection"] = self.collection
        if self.document is not None:
            out["document"] = self.document
        return out


def check_document(quotas: Quotas, doc_id: str, tokens: int, collection: str) -> None:
    """:class:`QuotaExceededError` when a document's ``tokens`` are over ``max_document_tokens``."""
    cap = quotas.max_document_tokens
    if cap is not None and tokens > cap:
        raise QuotaExceededError("max_document_tokens", cap, None, tokens, collection, doc_id)


def check_collection(quotas: Quotas, now: Usage, after: Usage) -> None:
    """:class:`QuotaExceededError` when ``after`` (the collection once the ingest commits) is over a
    collection limit and above ``now`` (an ingest that does not grow a usage is never refused)."""
    for limit, cur, new in (
        ("max_collection_tokens", now.tokens, after.tokens),
        ("max_collection_kv_bytes", now.kv_bytes, after.kv_bytes),
    ):
        cap = getattr(quotas, limit)
        if cap is not None and new > cap and new > cur:
            raise QuotaExceededError(limit, cap, cur, new, now.collection)


#: what :func:`measure_kv_bytes_per_token` encodes (repeated to the sample's length)
SAMPLE_TEXT = (
    "The river town grew up around a stone bridge built in 1642 by the masons of the abbey. Its market "
    "sold wool, salt and dried fish; in winter the ferrymen carried grain across when ice closed the "
    "upper fords. A fire in 1791 destroyed the guild hall and most of its records, so what is known of "
    "the early council comes from letters kept in the cathedral library, among them a complaint about "
    "tolls, a list of thirty-one households and the accounts of a school that taught Latin, arithmetic "
    "and the keeping of ledgers. "
)
_MEASURED: dict[tuple, int] = {}
_MEASURE_LOCK = threading.Lock()


def measure_kv_bytes_per_token(model, store, sample_tokens: int = 256) -> int:
    """Bytes per token of ``store``'s blob of the KV of :data:`SAMPLE_TEXT` (``sample_tokens`` tokens,
    at most the model's context) computed by ``model``, rounded up; cached per model, codec and size.
    A store without a codec of its own is counted at the KV's in-memory size (no encoding)."""
    from ragkv.model.forward import compute_chunk_kv
    from ragkv.store import blob as blobfmt

    codec = getattr(store, "codec", None)
    n = max(1, min(int(sample_tokens), model.config.max_position - 2))
    ident = (
        model.fingerprint,
        getattr(codec, "name", None),
        repr(sorted(codec.params().items())) if codec is not None else None,
        n,
    )
    with _MEASURE_LOCK:
        if ident in _MEASURED:
            return _MEASURED[ident]
        one = list(model.tokenizer(SAMPLE_TEXT, add_special_tokens=False)["input_ids"])
        kv = compute_chunk_kv(model, (one * math.ceil(n / len(one)))[:n])
        if codec is None:
            size = kv.nbytes()
        else:
            size = len(blobfmt.encode_chunk(kv, codec, getattr(store, "auth", blobfmt.UNKEYED)))
        _MEASURED[ident] = out = max(1, math.ceil(size / n))
        return out
