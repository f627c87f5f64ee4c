"""llama-index-llms-ragkv's own surface on the tiny model (real parts, no mocks): LlamaIndex's LLM
conventions of ``RagkvLlamaLLM`` (async methods that leave the event loop free; the prompt hooks
``system_prompt``, ``completion_to_prompt``, ``messages_to_prompt``, ``formatted``; the chat template for
plain completions; constructor parameters), answers over stored chunks named by id with their KV reused,
and stop strings that never leak."""

from __future__ import annotations

import asyncio
import threading

import pytest
from llama_index.core.llms import ChatMessage
from llama_index.llms.ragkv import RagkvLlamaLLM

from ragkv import LLM
from ragkv.blend import DEFAULT_RATIO
from ragkv.generate import Detokenizer
from ragkv.rag import RAG
from ragkv.testing import CHATML_TEMPLATE, check_stop_strings, musique_rag, stories_path


@pytest.fixture(scope="module")
def rag(tmp_path_factory, one_thread, embedder):
    """The tiny model (no chat template) over six short MuSiQue passages, each chunk's KV stored."""
    r = musique_rag(tmp_path_factory.mktemp("llm") / "data", embedder, chars=160)
    yield r
    r.close()


@pytest.fixture(scope="module")
def chat_rag(tmp_path_factory, one_thread, embedder):
    """The tiny model with a chat template on its (real) tokenizer: what an instruct model has."""
    llm = LLM(str(stories_path()))
    llm.model.tokenizer.chat_template = CHATML_TEMPLATE
    r = RAG(
        llm,
        tmp_path_factory.mktemp("li-chat") / "data",
        embedder=embedder,
        chunk_tokens=64,
        ratio=DEFAULT_RATIO,
    )
    yield r
    r.close()


def _loop_runs_at_each_token(monkeypatch, make_coro) -> tuple[object, list[bool]]:
    """``make_coro()``'s result, and per generated token whether the event loop ran a callback the test
    scheduled from the generating thread while that token was being produced.

    At every token (``Detokenizer.accept``) the generating thread hands the loop a callback and waits
    for it: a free loop runs it at once; a token produced on the loop's own thread is recorded as
    False without waiting (it would wait forever); a loop blocked elsewhere leaves the wait to its
    generous deadline, False too. Ordering, not timing: no gap is measured."""
    ran_at: list[bool] = []
    accept = Detokenizer.accept

    async def run():
        loop, loop_thread = asyncio.get_running_loop(), threading.get_ident()

        def witnessed_accept(self, tok):
            if threading.get_ident() == loop_thread:
                ran_at.append(False)
            else:
                ran = threading.Event()
                loop.call_soon_threadsafe(ran.set)
                ran_at.append(ran.wait(60))
            return accept(self, tok)

        monkeypatch.setattr(Detokenizer, "accept", witnessed_accept)
        try:
            return await make_coro()
        finally:
            monkeypatch.setattr(Detokenizer, "accept", accept)

    return asyncio.run(run()), ran_at


def test_async_methods_do_not_block_the_event_loop(rag, monkeypatch):
    """Each async method generates off the loop: at every token, the loop runs a callback scheduled
    while that token is produced (it was: gaps between 10 ms ticks under 50 ms)."""
    llm = RagkvLlamaLLM(rag=rag, max_tokens=150)
    nodes = [r.chunk_id for r in rag.retrieve("Who wrote it?", 3)]
    sync = llm.complete("Who wrote it?", chunk_ids=nodes)

    async def collect(agen_coro):
        return [r async for r in await agen_coro]

    msgs = [ChatMessage(role="user", content="Who wrote it?")]
    for make in (
        lambda: llm.acomplete("Who wrote it?", chunk_ids=nodes),
        lambda: collect(llm.astream_complete("Who wrote it?", chunk_ids=nodes)),
        lambda: llm.achat(msgs, chunk_ids=nodes),
        lambda: collect(llm.astream_chat(msgs, chunk_ids=nodes)),
    ):
        out, ran_at = _loop_runs_at_each_token(monkeypatch, make)
        assert len(ran_at) >= 2 and all(ran_at), ran_at  # the loop ran while each token was generated
        last = out[-1] if isinstance(out, list) else out
        text = last.text if hasattr(last, "text") else last.message.content
        assert text == sync.text and last.raw["ragkv"]["kv_hits"] == 3


def _prompt_tokens(resp) -> int:
    return resp.raw["ragkv"]["num_tokens"] if "num_tokens" in resp.raw["ragkv"] else -1


def test_plain_completion_uses_the_chat_template_and_system_prompt(chat_rag):
    model = chat_rag.model
    llm = RagkvLlamaLLM(rag=chat_rag, max_tokens=6, system_prompt="Be brief.")
    assert llm.metadata.is_chat_model
    rendered = model.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert llm.completion_prompt("Hello") == rendered  # was: "Hello" as is (system prompt ignored)
    templated = llm.complete("Hello")
    assert templated.text == llm.complete(rendered, formatted=True).text
    assert templated.raw["ragkv"]["num_tokens"] == len(model.encode(rendered, add_bos=True))
    raw = llm.complete("Hello", formatted=True)  # formatted: sent as is
    assert raw.raw["ragkv"]["num_tokens"] == len(model.encode("Hello", add_bos=True))
    # a custom completion_to_prompt formats the (system-prefixed) prompt instead of the template
    custom = RagkvLlamaLLM(
        rag=chat_rag, max_tokens=6, system_prompt="Be brief.", completion_to_prompt=lambda p: f"Q: {p}\nA:"
    )
    assert custom.completion_prompt("Hello") == "Q: Be brief.\n\nHello\nA:"
    assert custom.complete("Hello").text == llm.complete("Q: Be brief.\n\nHello\nA:", formatted=True).text


def test_chat_uses_messages_to_prompt_or_the_template(chat_rag):
    msgs = [ChatMessage(role="user", content="Hello")]
    llm = RagkvLlamaLLM(rag=chat_rag, max_tokens=6, system_prompt="Be brief.")
    rendered = llm.completion_prompt("Hello")
    assert llm.chat_prompt(msgs) == rendered
    assert llm.chat(msgs).message.content == llm.complete(rendered, formatted=True).text
    custom = RagkvLlamaLLM(
        rag=chat_rag,
        max_tokens=6,
        system_prompt="Be brief.",
        messages_to_prompt=lambda ms: "".join(f"[{m.role.value}] {m.content}\n" for m in ms),
    )
    assert custom.chat_prompt(msgs) == "[system] Be brief.\n[user] Hello\n"
    assert custom.chat(msgs).message.content == llm.complete(custom.chat_prompt(msgs), formatted=True).text


def test_without_a_chat_template_the_system_prompt_is_prepended(rag):
    llm = RagkvLlamaLLM(rag=rag, max_tokens=4, system_prompt="Once upon a time")
    assert not llm.metadata.is_chat_model
    assert llm.completion_prompt("there was a cat") == "Once upon a time\n\nthere was a cat"
    # with chunks the system prompt goes with the question into ragkv's RAG prompt
    q = "Who wrote it?"
    nodes = [r.chunk_id for r in rag.retrieve(q, 2)]
    plain = RagkvLlamaLLM(rag=rag, max_tokens=4).complete(f"Once upon a time\n\n{q}", chunk_ids=nodes)
    assert llm.complete(q, chunk_ids=nodes).text == plain.text


def test_unknown_constructor_parameters_are_refused(rag):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        RagkvLlamaLLM(rag=rag, max_token=8)
    assert RagkvLlamaLLM(rag=rag, max_tokens=5).metadata.num_output == 5


def test_instruct_model_plain_completion_is_not_empty(tmp_path, embedder):
    """On the real instruct model a bare question used to come back empty (no chat template applied)."""
    from ragkv.model import DEFAULT_MODEL
    from ragkv.model.registry import ModelFetchError, pull

    try:
        pull(DEFAULT_MODEL, quiet=True)
    except ModelFetchError as e:
        pytest.skip(f"default model not available: {e}")
    r = RAG(LLM(DEFAULT_MODEL), tmp_path / "data", embedder=embedder, ratio=DEFAULT_RATIO)
    try:
        llm = RagkvLlamaLLM(rag=r, max_tokens=12)
        out = llm.complete("What is the capital of France?")
        assert out.text.strip() and "Paris" in out.text
        # the ChatML template's first <|im_start|> (SmolLM2's BOS text, which its tokenizer does not
        # add) is kept: it was cut off as if the encoding would add it back
        rendered = llm.completion_prompt("What is the capital of France?")
        assert rendered.startswith("<|im_start|>system\n")
        ids = r.model.encode(rendered, add_bos=True, specials=True)  # a rendered template: its tokens parsed
        assert ids[0] == r.model.config.bos_token_id and out.raw["ragkv"]["num_tokens"] == len(ids)
    finally:
        r.close()


def test_stop_strings_never_leak_and_finish_reason_is_right(rag):
    q = "Who wrote it?"
    nodes = [r.chunk_id for r in rag.retrieve(q, 3)]

    def complete(stop, n, streamed):
        llm = RagkvLlamaLLM(rag=rag, max_tokens=n, stop=[stop])
        if not streamed:
            r = llm.complete(q, chunk_ids=nodes)
            return r.text, r.raw["finish_reason"]
        rs = list(llm.stream_complete(q, chunk_ids=nodes))
        assert rs[-1].text == "".join(r.delta for r in rs)
        return "".join(r.delta for r in rs), rs[-1].raw["finish_reason"]

    pieces = [r.delta for r in RagkvLlamaLLM(rag=rag, max_tokens=24).stream_complete(q, chunk_ids=nodes)]
    check_stop_strings(pieces, 24, complete)
