"""Prompt parts around the retrieved chunks: ``[instruction prefix] + chunks + [question suffix]``."""

from __future__ import annotations

DEFAULT_INSTRUCTION = (
    "You will be asked a question after reading several passages. Please directly answer the question "
    "based on the given passages. Do NOT repeat the question. The answer should be within 5 words."
)
DEFAULT_QUESTION = (
    "\n\nAnswer the question directly based on the given passages. Question: {question}\nAnswer:"
)
_MARK = "\u2063RAGKV_CHUNKS\u2063"


def prompt_parts(
    model,
    question: str,
    instruction: str = DEFAULT_INSTRUCTION,
    question_template: str = DEFAULT_QUESTION,
    use_chat_template: bool | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids of the prefix (BOS + instruction, chat head) and suffix (question, chat tail).

    With a chat template (used when the tokenizer has one, unless disabled) the user message is
    rendered with a marker where the passages go; the text before it becomes the prefix and the
    text after it the suffix, so the passages stay separate chunks whose KV is reused.
    """
    if not question or not question.strip():
        raise ValueError("empty question")
    tok = model.tokenizer
    q = question_template.format(question=question.strip())
    has_template = bool(tok is not None and getattr(tok, "chat_template", None))
    if use_chat_template is None:
        use_chat_template = has_template
    if use_chat_template and has_template:
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": f"{instruction}\n\n{_MARK}{q}"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        head, tail = rendered.split(_MARK)
        prefix = tok.encode(head, add_special_tokens=False)
        bos = model.config.bos_token_id
        if bos is not None and (not prefix or prefix[0] != bos):
            prefix = [bos] + prefix
        return prefix, tok.encode(tail, add_special_tokens=False)
    return model.encode(instruction + "\n\n", add_bos=True), model.encode(q)
