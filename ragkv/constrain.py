"""Constrained decoding: output that is one JSON value matching a JSON schema (OpenAI's ``response_format``).

A :class:`JsonConstraint` is what a request asks for: a JSON schema, or any JSON object (OpenAI's
``json_object``). It is checked when made (an invalid or unsupported schema raises
:class:`ConstraintError`, a ``ValueError``) and started once per generation, against the model's
tokenizer, as a :class:`GrammarState`: the set of tokens each step may take, and the tokens taken.
:mod:`ragkv.generate` applies it where logits become tokens (``Detokenizer.step``), the one place
every generation mode (``stream``, the RAG pipeline, the batching engine) goes through.

The grammar engine is llguidance (``pip install ragkv[structured]``): on SmolLM2's 49K vocabulary a
schema compiles in about a millisecond and a token mask takes tens of microseconds, against a decode
step of milliseconds (docs/BENCHMARKS.md, "Structured output (issue 26 item 4)").

Stop tokens (the model's EOS, a request's ``stop_token_ids``) may end a constrained generation only
where its JSON is complete, and once it is complete nothing but a stop token may follow: a generation
that finishes with "stop" holds valid JSON; one cut by its token limit finishes with "length".
JSON is written on one line, ``", "`` between items and ``": "`` after keys (no free whitespace, which
small models otherwise repeat until their token limit), and an object schema that lists its
``properties`` but says nothing of others gets no others (``additionalProperties: false``, xgrammar's
"strict mode" and so vLLM's default): the output still matches the schema, and a small model cannot
go on adding made-up keys until its token limit.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

#: how JSON is written: one line, these separators (no free whitespace)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: the schema of OpenAI's ``{"type": "json_object"}``: any JSON object
ANY_OBJECT: dict = {"type": "object"}

_SHIFTS = torch.arange(8, dtype=torch.uint8)
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


class ConstraintError(ValueError):
    """A constraint that cannot be used: an invalid or unsupported schema, or no grammar engine."""


def _llguidance():
    """The llguidance module, or :class:`ConstraintError` saying how to install it."""
    try:
        import llguidance
        import llguidance.hf  # noqa: F401 - the tokenizer adapter
    except ImportError:
        raise ConstraintError("structured output needs llguidance: pip install 'ragkv[structured]'") from None
    return llguidance


@dataclass(frozen=True)
class JsonConstraint:
    """Output that is one JSON value matching ``schema`` (default: any JSON object).

    Raises :class:`ConstraintError` when the schema is not a JSON object, is invalid, or uses what
    the grammar engine does not support (an unknown ``format``, a bad ``pattern`` ...): refused
    rather than loosely followed, so a finished output always matches it.
    """

    schema: Mapping[str, Any] = field(default_factory=lambda: dict(ANY_OBJECT))
    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "grammar", compile_schema(self.schema))

    def start(self, model) -> GrammarState:
        """A fresh state of this constraint for one generation of ``model``."""
        llg = _llguidance()
        tok = ll_tokenizer(model)
        matcher = llg.LLMatcher(tok, self.grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"invalid JSON schema: {matcher.get_error()}")
        return GrammarState(matcher, model.config.vocab_size, tok.eos_token)


def json_constraint(schema: Mapping[str, Any] | None = None) -> JsonConstraint:
    """A :class:`JsonConstraint` of ``schema`` (None: any JSON object, OpenAI's ``json_object``)."""
    return JsonConstraint(dict(ANY_OBJECT) if schema is None else schema)


def compile_schema(schema: Any) -> str:
    """llguidance's grammar of a JSON schema, validated; :class:`ConstraintError` with the reason."""
    if not isinstance(schema, Mapping):
        raise ConstraintError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    try:
        text = json.dumps(schema)
    except RecursionError:
        raise ConstraintError("the JSON schema is nested too deeply") from None
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"the JSON schema is not JSON: {e}") from None
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(
            json.dumps(close_objects(json.loads(text))), defaults=JSON_OPTIONS
        )
    except RecursionError:
        raise ConstraintError("the JSON schema is nested too deeply") from None
    except (ValueError, RuntimeError) as e:
        raise ConstraintError(f"invalid JSON schema: {e}") from None
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise ConstraintError(f"invalid or unsupported JSON schema: {'; '.join(messages)}")
    return grammar


#: keywords whose value is one subschema, a list of them, or a name -> subschema map
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_LIST = ("items", "prefixItems", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: keywords that say what an object's unlisted keys may be
_OTHER_KEYS = {"additionalProperties", "patternProperties", "unevaluatedProperties"}


def close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists ``properties``
    and says nothing of other keys (not inside ``allOf``, whose parts each list only some)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and not _OTHER_KEYS & out.keys():
        out["additionalProperties"] = False
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: close_objects(v) for k, v in out[key].items()}
    return out


def ll_tokenizer(model):
    """llguidance's view of ``model``'s tokenizer (every token's bytes), built once per tokenizer."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ConstraintError("structured output needs the model's tokenizer; this model has none")
    with _tokenizers_lock:
        tok = _tokenizers.get(tokenizer)
        if tok is None:
            tok = _llguidance().hf.from_tokenizer(tokenizer, n_vocab=model.config.vocab_size)
            _tokenizers[tokenizer] = tok
    return tok


def token_bytes(model, token_id: int) -> bytes:
    """The bytes of one token as the tokenizer defines them (a token may hold part of a character)."""
    try:
        return bytes(ll_tokenizer(model).decode_bytes([int(token_id)]))
    except ConstraintError:  # no llguidance: the token's own text (whole characters only)
        return model.decode([int(token_id)]).encode()


class GrammarState:
    """One generation's place in its grammar: which tokens may come next, and the tokens taken."""

    def __init__(self, matcher, vocab_size: int, eos_token: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token = eos_token
        self._bits = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    @property
    def complete(self) -> bool:
        """The output so far is a whole JSON value of the schema (a stop token may end it here)."""
        return bool(self.matcher.is_accepting())

    def allowed(self, stop_ids: frozenset[int]) -> torch.Tensor:
        """Bool ``[vocab]``: the tokens that keep the output on the grammar; the stop tokens only
        where the JSON is complete (the grammar's own EOS only as one of them)."""
        m = self.matcher
        m.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        if m.is_error():
            raise ConstraintError(f"constrained decoding failed: {m.get_error()}")
        bits = self._bits.view(torch.uint8).unsqueeze(-1) >> _SHIFTS
        ok = (bits & 1).bool().flatten()[: self.vocab_size]
        if 0 <= self.eos_token < self.vocab_size:
            ok[self.eos_token] = False
        stops = [t for t in stop_ids if 0 <= t < self.vocab_size]
        if stops:
            ok[stops] = self.complete
        return ok

    def advance(self, token_id: int) -> None:
        """Take ``token_id`` (one :meth:`allowed` permitted)."""
        if not self.matcher.consume_token(int(token_id)):
            raise ConstraintError(f"constrained decoding failed: {self.matcher.get_error()}")
