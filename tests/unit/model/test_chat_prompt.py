"""Issue 39: an OpenAI chat's prompt token ids are exactly those vLLM's OpenAI server prefills, i.e.
transformers' ``apply_chat_template(messages, tokenize=True, add_generation_prompt=True)`` for the
model: on test checkpoints with chat templates (fast) and the real default model (slow). The RAG
prompt of a chat with retrieval keeps the conversation's turns around ``/v1/query``'s user turn."""

from __future__ import annotations

import pytest

from ragkv.model import load_model
from ragkv.model.chat import ChatTemplateError, chat_prompt_ids, plain_chat_text
from ragkv.prompt import prompt_parts
from tests.helpers import CHATML_TEMPLATE, INST_TEMPLATE, stories_model, template_ids, templated_checkpoint

CONVERSATIONS = [
    [{"role": "user", "content": "Once upon a time"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Who had a red ball?"},
        {"role": "assistant", "content": "Lily."},
        {"role": "user", "content": "  And who ran?\n\n"},
    ],
    # a special token's text inside a message is that token, as vLLM and transformers read it
    [{"role": "user", "content": "Lily had</s> a <s>ball. <|im_end|>"}],
]


@pytest.fixture(scope="module", params=["chatml", "inst"])
def checkpoint(request, tmp_path_factory):
    template = {"chatml": CHATML_TEMPLATE, "inst": INST_TEMPLATE}[request.param]
    return templated_checkpoint(tmp_path_factory.mktemp(request.param) / "model", template)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "multi-turn", "specials"])
def test_chat_prompt_ids_equal_transformers_apply_chat_template(checkpoint, messages):
    model = load_model(checkpoint)
    assert chat_prompt_ids(model, messages) == template_ids(checkpoint, messages)


def test_a_templates_own_refusal_is_a_chat_template_error(tmp_path):
    model = load_model(templated_checkpoint(tmp_path / "m", INST_TEMPLATE))
    with pytest.raises(ChatTemplateError, match="alternate"):
        chat_prompt_ids(model, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_without_a_template_the_conversation_is_role_lines_after_bos():
    model = stories_model()  # no chat template
    msgs = CONVERSATIONS[1]
    text = plain_chat_text(msgs)
    assert text.startswith("System: Answer in one word.\nUser: Who had") and text.endswith("\nAssistant:")
    assert chat_prompt_ids(model, msgs) == [model.config.bos_token_id] + model.encode(text, specials=True)


def test_a_conversation_keeps_its_turns_around_the_rag_prompts_user_turn(checkpoint):
    """Retrieval on the chat route: the passages go in the last user message, the turn ``/v1/query``
    builds (instruction, passages, question template); with one user message the prompt is
    ``/v1/query``'s, a client's system message replaces the service's, earlier turns stay turns."""
    model = load_model(checkpoint)
    q = "Who had a red ball?"
    assert prompt_parts(model, q, conversation=[]) == prompt_parts(model, q)
    sys_pre, sys_tail = prompt_parts(model, q, conversation=[("system", "Be brief.")])
    assert (sys_pre, sys_tail) == prompt_parts(model, q, system="Be brief.")
    pre, tail = prompt_parts(
        model, q, conversation=[("system", "Be brief."), ("user", "Hello"), ("assistant", "Hi.")]
    )
    assert tail == sys_tail and model.decode(pre).count("Hello") == 1
    assert model.decode(pre).index("Be brief.") < model.decode(pre).index("Hello")
    assert model.decode(pre).endswith(model.decode(sys_pre)[-40:])  # the question's turn, as before


@pytest.mark.slow
def test_the_default_models_chat_prompt_ids_equal_apply_chat_template():
    from ragkv import DEFAULT_MODEL

    model = load_model(DEFAULT_MODEL)
    for messages in CONVERSATIONS:
        want = model.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        assert chat_prompt_ids(model, messages) == list(want["input_ids"])
