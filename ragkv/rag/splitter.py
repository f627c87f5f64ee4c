"""Split documents into token-bounded chunks of the serving model's tokenizer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextChunk:
    """A chunk of a document: its exact token ids (what the KV is computed from) and its text."""

    seq: int
    token_ids: tuple[int, ...]
    text: str


def split_tokens(
    tokenizer, text: str, chunk_tokens: int = 512, overlap: int = 0, min_tokens: int = 1
) -> list[TextChunk]:
    """Windows of at most ``chunk_tokens`` tokens, ``overlap`` tokens shared between neighbours.

    Token ids are kept as tokenized from the whole document (never re-tokenized), so the stored KV
    is exactly that of the ids the prompt will contain. Window ends snap back (by at most a quarter
    window) to a token that starts a word, so chunks rarely cut words in half.
    """
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be >= 1")
    if not 0 <= overlap < chunk_tokens:
        raise ValueError("overlap must be in [0, chunk_tokens)")
    ids, offsets = encode_with_offsets(tokenizer, text)
    n = len(ids)
    chunks: list[TextChunk] = []
    start = 0
    while start < n:
        end = min(start + chunk_tokens, n)
        if end < n:
            floor = end - chunk_tokens // 4
            cut = end
            while cut > max(floor, start + 1) and not _starts_word(text, offsets, cut):
                cut -= 1
            if cut > start + 1 and _starts_word(text, offsets, cut):
                end = cut
        if end - start >= min_tokens:
            a, b = offsets[start][0], offsets[end - 1][1]
            chunks.append(TextChunk(len(chunks), tuple(ids[start:end]), text[a:b]))
        if end >= n:
            break
        start = max(end - overlap, start + 1)
    return chunks


class _TokenSpans:
    """``offsets[i]`` of a Rust encoding, read per token (only chunk ends are ever looked at)."""

    def __init__(self, encoding):
        self.encoding = encoding

    def __getitem__(self, i: int) -> tuple[int, int]:
        return self.encoding.token_to_chars(i)


def encode_with_offsets(tokenizer, text: str, specials: bool = False):
    """``(token ids, per-token (start, end) character offsets)`` of ``text`` without special tokens. A
    special token's text in ``text`` is encoded as text (the Rust path parses it, so such a text takes
    the HF call), or with ``specials`` as that token (a model's raw prompt).

    A fast tokenizer's Rust backend encodes with the GIL released (``encode_batch``) and offsets are
    read per token on demand: the HF call's full offset list of a 2M-character document holds the
    GIL for ~200 ms, stalling the service's event loop and its queries. Same ids and offsets as the
    HF call (tested); other tokenizers, or a backend left with truncation or padding, take that call.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - transformers' fast tokenizers need it
        Tokenizer = None
    if (
        Tokenizer is not None
        and isinstance(backend, Tokenizer)
        and backend.truncation is None
        and backend.padding is None
        and not getattr(tokenizer, "split_special_tokens", False)
        and _specials_agree(tokenizer, backend, text, specials)
    ):
        enc = backend.encode_batch([text], add_special_tokens=False)[0]
        return enc.ids, _TokenSpans(enc)
    enc = tokenizer(
        text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=not specials
    )
    return enc["input_ids"], enc["offset_mapping"]


def _specials_agree(tokenizer, backend, text: str, specials: bool) -> bool:
    """Whether the Rust backend, as it is now, treats special tokens' texts as asked. ``specials``: it
    must parse them (transformers' own calls with ``split_special_tokens=True``, e.g. rendering a chat
    prompt, leave the shared backend splitting them). A document's text (not ``specials``) must have
    none (such a text takes the HF call, which keeps them text); without one the backend's flag
    changes nothing, so a flag left set never sends every later split down the GIL-holding path."""
    if specials:
        return not backend.encode_special_tokens
    return not any(t in text for t in _special_texts(tokenizer))


def _special_texts(tokenizer) -> list[str]:
    """The texts of the tokenizer's special tokens: typed in a document they stay text (issue 24)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return [t.content for t in added.values() if getattr(t, "special", False) and t.content]


def _starts_word(text: str, offsets, i: int) -> bool:
    a = offsets[i][0]
    return a == 0 or text[a - 1].isspace() or text[a : a + 1].isspace()
