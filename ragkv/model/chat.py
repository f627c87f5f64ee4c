"""Prompts the way the model's tokenizer would build them: BOS as the tokenizer adds it, chat templates.

Chunks sit *inside* the user's message (between an instruction head and a question tail), so the
message is rendered once with a marker where the chunks go and split there: the text before it is
the prompt head, the text after it the tail, and the chunks stay separate token runs whose KV is
reused.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_MARK = "\u2063RAGKV_CHUNKS\u2063"


def tokenizer_adds_bos(tokenizer, bos_token_id: int | None) -> bool:
    """Whether ``tokenizer.encode(text)`` starts with BOS by itself (Llama-2 style: yes; ChatML: no)."""
    if tokenizer is None or bos_token_id is None:
        return bos_token_id is not None
    ids = tokenizer.encode("a", add_special_tokens=True)
    return bool(ids) and ids[0] == bos_token_id


def has_chat_template(model) -> bool:
    tok = model.tokenizer
    return bool(tok is not None and getattr(tok, "chat_template", None))


def chat_parts(
    model,
    head: str,
    tail: str,
    system: str | None = None,
    examples: Sequence[tuple[str, str]] = (),
    history: Sequence[tuple[str, str]] = (),
) -> tuple[list[int], list[int]]:
    """Token ids before and after the chunks of a chat whose last user message is
    ``head + <chunks> + tail``, with the generation prompt (assistant turn) at the end of the tail.

    The model's default system prompt (if its template has one) is kept unless ``system`` is given.
    ``examples`` are few-shot ``(user, assistant)`` turns rendered before that message: they belong
    to the prompt head, so their KV is cached with it and costs nothing per query. ``history``:
    ``(role, text)`` turns of a conversation, rendered after the examples and before that message
    (a chat client's earlier turns).
    A head that does not start with BOS gets it when the model has one, so chunk KV (computed after
    BOS, docs/CHUNK_CONVENTION.md) always follows a BOS row.
    """
    tok = model.tokenizer
    if not has_chat_template(model):
        raise ValueError(f"model {model.name!r} has no chat template")
    turns = [*([("system", system)] if system is not None else [])]
    turns += [(role, t) for pair in examples for role, t in zip(("user", "assistant"), pair, strict=True)]
    turns += [(str(r), str(t)) for r, t in history]
    # every message's content is a marker in the rendered template: the template's own text is
    # encoded with its control tokens, the contents as text (a typed "<|im_end|>" stays text)
    texts = [t for _, t in turns] + [head, tail]
    if _trims_content(tok):  # as the template trims each message: head and tail are one message
        texts = [t.strip() for t in texts[:-2]] + [texts[-2].lstrip(), texts[-1].rstrip()]
    mark = [f"\u2063RAGKV_{i}\u2063" for i in range(len(texts))]
    messages = [{"role": role, "content": mark[i]} for i, (role, _) in enumerate(turns)]
    messages.append({"role": "user", "content": f"{mark[-2]}{_MARK}{mark[-1]}"})
    rendered = render_template(tok, messages)
    before, after = rendered.split(_MARK)
    prefix = _encode_marked(tok, before, mark, texts)
    bos = model.config.bos_token_id
    if bos is not None and (not prefix or prefix[0] != bos):
        prefix = [bos] + prefix
    return prefix, _encode_marked(tok, after, mark, texts)


def render_parts(model, head: str, tail: str, chat: bool, **turns) -> tuple[list[int], list[int]]:
    """Token ids before and after the chunks: ``head`` and ``tail`` in one user turn of the chat
    template (``turns``: ``system``, ``examples``, ``history`` as :func:`ragkv.model.chat.chat_parts`
    takes them), or as plain text with BOS first (when the tokenizer adds one). The one renderer: the
    prompt convention (:mod:`ragkv.prompt`) and the codec calibration's prompts go through it."""
    if chat:
        return chat_parts(model, head, tail, **turns)
    return model.encode(head, add_bos=True), model.encode(tail)


def _encode_marked(tok, rendered: str, marks: list[str], texts: list[str]) -> list[int]:
    """Token ids of ``rendered``: template text with its special tokens parsed, each marker replaced
    by its content encoded as text. The pieces meet where the template puts a role line or a
    control token, so they tokenize as the whole string would (tested on the shipped templates)."""
    content = dict(zip(marks, texts, strict=True))
    ids: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, marks)) + ")", rendered):
        if piece in content:
            text = content[piece]
            ids += tok.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []
        elif piece:
            ids += tok.encode(piece, add_special_tokens=False)
    return ids


#: chat template text -> whether it trims message contents (rendered once per template)
_TRIMS: dict[str, bool] = {}


def _trims_content(tok) -> bool:
    """Whether the chat template strips a message's surrounding white space (Llama 3's ``| trim``)."""
    template = str(tok.chat_template)
    if template not in _TRIMS:
        probe = [{"role": "user", "content": " \u2063probe\u2063 "}]
        _TRIMS[template] = " \u2063probe\u2063 " not in tok.apply_chat_template(probe, tokenize=False)
    return _TRIMS[template]


class ChatTemplateError(ValueError):
    """The model's chat template refused a conversation (e.g. roles that do not alternate)."""


def render_template(tok, messages: Sequence[dict]) -> str:
    """``messages`` rendered by the tokenizer's chat template with the generation prompt (as
    transformers' ``apply_chat_template`` and vLLM's OpenAI server render them); a template's own
    refusal (``raise_exception``) is a :class:`ChatTemplateError` with its message."""
    from jinja2.exceptions import TemplateError

    try:
        return tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template refused the messages: {e}") from None


def plain_chat_text(messages: Sequence[dict]) -> str:
    """A conversation as plain text for a model without a chat template: ``Role: text`` lines, then
    ``Assistant:`` (ragkv's convention; vLLM refuses such a model's chat requests)."""
    return (
        "".join(f"{str(m['role']).capitalize()}: {m.get('content') or ''}\n" for m in messages) + "Assistant:"
    )


def chat_prompt_ids(model, messages: Sequence[dict]) -> list[int]:
    """The prompt token ids of an OpenAI chat request, exactly as vLLM's OpenAI server builds them:
    ``messages`` (``{"role", "content", "name"?}``, content a string) rendered by the model's chat
    template with the generation prompt, and the text tokenized whole without added special tokens
    (so a special token's text inside a message is that token, as in vLLM and transformers'
    ``apply_chat_template(..., tokenize=True)``, whose ids these equal). Without a chat template:
    :func:`plain_chat_text`, tokenized with BOS when the tokenizer adds one."""
    tok = model.tokenizer
    if tok is None:
        raise ValueError("this model has no tokenizer; chat needs one")
    if has_chat_template(model):
        return tok.encode(render_template(tok, messages), add_special_tokens=False)
    return model.encode(plain_chat_text(messages), add_bos=True, specials=True)
