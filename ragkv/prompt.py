"""The prompt convention of every surface: ``[instruction prefix] + chunks + [question suffix]``.

One renderer (:func:`ragkv.model.chat.render_parts`, beside the chat template it applies) turns a head and a tail text into token ids around the chunks,
with the model's chat template (one user turn, the chunks inside it) or as plain text (BOS first);
a RAG's prompt (:func:`prompt_parts`) and a caller's own parts (:func:`tokenize_parts`, what
``ragkv.LLM`` takes) both go through it. Below the LLM, RAG and the fidelity gate (which measures
blends on the same prompts users send)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from ragkv.model.chat import has_chat_template, render_parts

DEFAULT_INSTRUCTION = (
    "You will be asked a question after reading several passages. Please directly answer the question "
    "based on the given passages. Do NOT repeat the question. The answer should be within 5 words."
)
DEFAULT_QUESTION = (
    "\n\nAnswer the question directly based on the given passages. Question: {question}\nAnswer:"
)


#: the prompt settings a RAG takes (``RAG(**options)``, :func:`prompt_parts`) and a prompt file may set
PROMPT_KEYS = ("instruction", "question_template", "system", "examples")


def prompt_options(source: Mapping | str | Path | None) -> dict:
    """The prompt settings (:data:`PROMPT_KEYS`) of a mapping or a JSON file, e.g. the demo corpus.

    One reader for ``ragkv demo`` (its corpus), ``ragkv-server ask`` and ``ragkv-server serve`` (``--prompt-file``),
    so they all ask the same way; other keys are ignored, ``None`` gives no settings.
    """
    if source is None:
        return {}
    if not isinstance(source, Mapping):
        source = json.loads(Path(source).read_text())
        if not isinstance(source, Mapping):
            raise ValueError(f"prompt file {source!r}: expected a JSON object")
    out = {k: source[k] for k in PROMPT_KEYS if source.get(k) is not None}
    if "examples" in out:
        out["examples"] = [(str(u), str(a)) for u, a in out["examples"]]
    return out


def prompt_parts(
    model,
    question: str,
    instruction: str = DEFAULT_INSTRUCTION,
    question_template: str = DEFAULT_QUESTION,
    use_chat_template: bool | None = None,
    system: str | None = None,
    examples: Sequence[tuple[str, str]] = (),
    conversation: Sequence[tuple[str, str]] | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids of the prefix (BOS + instruction, chat head) and suffix (question, chat tail).

    With a chat template (used when the tokenizer has one, unless disabled) the user message is
    rendered with a marker where the passages go; the text before it becomes the prefix and the
    text after it the suffix, so the passages stay separate chunks whose KV is reused. ``system``
    replaces the template's default system prompt; ``examples`` are few-shot ``(user, answer)``
    turns before the question's turn (without a template: plain text after the instruction).
    Both sit in the prefix, whose KV the prefix cache keeps.

    ``conversation``: a chat client's ``(role, text)`` turns before the question (the service's
    ``/v1/chat/completions`` with retrieval). Its leading system (or developer) messages take the
    place of ``system``; its other turns follow the few-shot examples, as turns (without a template:
    ``Role: text`` lines after them). The question's turn, where the passages go, is the same as
    without a conversation.
    """
    if not question or not question.strip():
        raise ValueError("empty question")
    q = question_template.format(question=question.strip())
    turns = list(conversation or ())
    lead = 0
    while lead < len(turns) and turns[lead][0] in ("system", "developer"):
        lead += 1
    if lead:
        system = "\n\n".join(t for _, t in turns[:lead])
    history = turns[lead:]
    if use_chat_template is None:
        use_chat_template = has_chat_template(model)
    if use_chat_template and has_chat_template(model):
        return render_parts(
            model, f"{instruction}\n\n", q, True, system=system, examples=examples, history=history
        )
    head = (f"{system}\n\n" if system else "") + f"{instruction}\n\n"
    head += "".join(f"{user}\n{answer}\n\n" for user, answer in examples)
    head += "".join(f"{str(r).capitalize()}: {t}\n" for r, t in history) + ("\n" if history else "")
    return render_parts(model, head, q, False)


def tokenize_parts(
    model,
    prefix: str | Sequence[int],
    chunks: Sequence[str | Sequence[int]],
    question: str | Sequence[int],
    chat: bool | None = None,
    system: str | None = None,
) -> tuple[list[int], list[list[int]], list[int]]:
    """Token ids of a caller's ``prefix + chunks + question``, each part tokenized apart (chunks keep
    their own, reusable KV).

    With a chat template (``chat=None``: when the model has one; strings only) the prompt is one
    user turn ``prefix + chunks + question`` (blank lines between them) rendered by the template,
    ending with the assistant turn's header, and ``system`` replaces the template's default system
    prompt. Without one, the prefix starts with BOS if the tokenizer would add it. Token-id parts
    are used as given.
    """
    chs = [model.encode(c) if isinstance(c, str) else list(c) for c in chunks]
    texts = isinstance(prefix, str) and isinstance(question, str)
    if chat is None:
        chat = texts and has_chat_template(model)
    if chat:
        if not texts:
            raise ValueError("chat=True needs the prefix and question as strings")
        head = f"{prefix}\n\n" if prefix else ""
        tail = f"\n\n{question}" if chs else question
        pre, q = render_parts(model, head, tail, True, system=system)
        return pre, chs, q
    if texts:
        pre, q = render_parts(model, prefix, question, False)
        return pre, chs, q
    pre = model.encode(prefix, add_bos=True) if isinstance(prefix, str) else list(prefix)
    q = model.encode(question) if isinstance(question, str) else list(question)
    return pre, chs, q
