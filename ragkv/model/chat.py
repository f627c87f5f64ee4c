"""Prompts the way the model's tokenizer would build them: BOS as the tokenizer adds it, chat templates.

Chunks sit *inside* the user's message (between an instruction head and a question tail), so the
message is rendered once with a marker where the chunks go and split there: the text before it is
the prompt head, the text after it the tail, and the chunks stay separate token runs whose KV is
reused.
"""

from __future__ import annotations

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
) -> tuple[list[int], list[int]]:
    """Token ids before and after the chunks of a chat whose last user message is
    ``head + <chunks> + tail``, with the generation prompt (assistant turn) at the end of the tail.

    The model's default system prompt (if its template has one) is kept unless ``system`` is given.
    ``examples`` are few-shot ``(user, assistant)`` turns rendered before that message: they belong
    to the prompt head, so their KV is cached with it and costs nothing per query.
    A head that does not start with BOS gets it when the model has one, so chunk KV (computed after
    BOS, docs/CHUNK_CONVENTION.md) always follows a BOS row.
    """
    tok = model.tokenizer
    if not has_chat_template(model):
        raise ValueError(f"model {model.name!r} has no chat template")
    messages = [{"role": "system", "content": system}] if system is not None else []
    for user, assistant in examples:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": f"{head}{_MARK}{tail}"})
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    before, after = rendered.split(_MARK)
    prefix = tok.encode(before, add_special_tokens=False)
    bos = model.config.bos_token_id
    if bos is not None and (not prefix or prefix[0] != bos):
        prefix = [bos] + prefix
    return prefix, tok.encode(after, add_special_tokens=False)
