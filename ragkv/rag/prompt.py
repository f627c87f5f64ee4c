"""Prompt parts around the retrieved chunks: ``[instruction prefix] + chunks + [question suffix]``."""

from __future__ import annotations

from collections.abc import Sequence

from ragkv.model.chat import chat_parts, has_chat_template

DEFAULT_INSTRUCTION = (
    "You will be asked a question after reading several passages. Please directly answer the question "
    "based on the given passages. Do NOT repeat the question. The answer should be within 5 words."
)
DEFAULT_QUESTION = (
    "\n\nAnswer the question directly based on the given passages. Question: {question}\nAnswer:"
)


def prompt_parts(
    model,
    question: str,
    instruction: str = DEFAULT_INSTRUCTION,
    question_template: str = DEFAULT_QUESTION,
    use_chat_template: bool | None = None,
    system: str | None = None,
    examples: Sequence[tuple[str, str]] = (),
) -> tuple[list[int], list[int]]:
    """Token ids of the prefix (BOS + instruction, chat head) and suffix (question, chat tail).

    With a chat template (used when the tokenizer has one, unless disabled) the user message is
    rendered with a marker where the passages go; the text before it becomes the prefix and the
    text after it the suffix, so the passages stay separate chunks whose KV is reused. ``system``
    replaces the template's default system prompt; ``examples`` are few-shot ``(user, answer)``
    turns before the question's turn (without a template: plain text after the instruction).
    Both sit in the prefix, whose KV the prefix cache keeps.
    """
    if not question or not question.strip():
        raise ValueError("empty question")
    q = question_template.format(question=question.strip())
    if use_chat_template is None:
        use_chat_template = has_chat_template(model)
    if use_chat_template and has_chat_template(model):
        return chat_parts(model, f"{instruction}\n\n", q, system=system, examples=examples)
    head = (f"{system}\n\n" if system else "") + f"{instruction}\n\n"
    head += "".join(f"{user}\n{answer}\n\n" for user, answer in examples)
    return model.encode(head, add_bos=True), model.encode(q)
