"""Generation after any prefill mode: greedy parity with transformers, sampling, stops, streaming."""

import pytest
import torch

from ragkv import LLM, SamplingParams
from ragkv.blend import prefill
from ragkv.generate import Detokenizer, TokenEvent, generate, stream
from tests.helpers import stop_cases, stories_model, stories_path


def test_greedy_matches_transformers_generate():
    from transformers import AutoModelForCausalLM

    m = stories_model()
    ids = m.encode("Once upon a time", add_bos=True)
    res = prefill(m, ids, [], [], "full")
    ours = generate(m, res, SamplingParams(max_new_tokens=40)).token_ids
    hf = AutoModelForCausalLM.from_pretrained(stories_path()).eval()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0, len(ids) :].tolist()
    assert ours == out[: len(ours)] and len(ours) == 40


def test_sampling_is_seeded_and_respects_top_k():
    m = stories_model()
    res = prefill(m, m.encode("Lily", add_bos=True), [], [], "full")
    p = SamplingParams(max_new_tokens=15, temperature=1.0, top_k=5, top_p=0.9, seed=11)
    a, b = generate(m, res, p), generate(m, res, p)
    assert a.token_ids == b.token_ids
    c = generate(m, res, SamplingParams(max_new_tokens=15, temperature=1.0, seed=12))
    assert c.token_ids != a.token_ids


def test_stop_strings_and_tokens_and_streaming():
    m = stories_model()
    res = prefill(m, m.encode("Once upon a time", add_bos=True), [], [], "full")
    whole = generate(m, res, SamplingParams(max_new_tokens=30)).text
    assert "." in whole
    cut = generate(m, res, SamplingParams(max_new_tokens=30, stop=(".",)))
    assert cut.text == whole[: whole.index(".")] and cut.finish_reason == "stop"
    events = list(stream(m, res, SamplingParams(max_new_tokens=12)))
    assert (
        len(events) == 12
        and "".join(e.text for e in events) == generate(m, res, SamplingParams(max_new_tokens=12)).text
    )
    first = generate(m, res, SamplingParams(max_new_tokens=5)).token_ids[0]
    assert generate(m, res, SamplingParams(max_new_tokens=5, stop_token_ids=(first,))).token_ids == []


def test_bad_sampling_params():
    for bad in ({"max_new_tokens": -1}, {"temperature": -0.1}, {"top_p": 0}, {"top_k": -2}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_llm_entry_point_all_modes():
    llm = LLM(stories_model())
    assert llm.gate.ok and llm.model.blend_ok
    chunks = ["Lily had a red ball.", "Tom liked to run in the park.", "The sun was hot."]
    outs = {
        mode: llm.generate("Once upon a time.", chunks, " One day,", mode=mode, max_new_tokens=12)
        for mode in ("full", "prefix", "reuse", "blend")
    }
    for a in outs.values():
        assert a.text and a.ttft_s > 0 and len(a.token_ids) == 12
    # blend at ratio 1 reproduces full's greedy text
    assert (
        llm.generate(
            "Once upon a time.", chunks, " One day,", mode="blend", ratio=1.0, max_new_tokens=12
        ).text
        == outs["full"].text
    )
    assert outs["blend"].stats["recomputed_per_layer"][-1] < outs["full"].stats["recomputed_per_layer"][-1]
    with pytest.raises(Exception, match="exceeds"):
        llm.generate("", ["word " * 600], "q", mode="blend")


def test_denormal_temperature_is_greedy():
    m = stories_model()
    res = prefill(m, m.encode("Lily", add_bos=True), [], [], "full")
    greedy = generate(m, res, SamplingParams(max_new_tokens=5)).token_ids
    assert generate(m, res, SamplingParams(max_new_tokens=5, temperature=5e-324, seed=1)).token_ids == greedy


def test_readme_lower_level_names_exist():
    """The README's lower-level API, as it names it (``ragkv.generate`` is a module)."""
    import inspect

    import ragkv
    import ragkv.generate

    assert inspect.ismodule(ragkv.generate)
    for fn in (
        ragkv.load_model,
        ragkv.compute_chunk_kv,
        ragkv.prefill,
        ragkv.generate.generate,
        ragkv.generate.stream,
    ):
        assert callable(fn)
    m = ragkv.random_model("llama", seed=0)
    res = ragkv.prefill(m, [1], [ragkv.compute_chunk_kv(m, [5, 6, 7])], [8, 9], "blend", 0.15)
    out = ragkv.generate.generate(m, res, ragkv.SamplingParams(max_new_tokens=3, stop_token_ids=()))
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    assert [
        e.token_id
        for e in ragkv.generate.stream(m, res, ragkv.SamplingParams(max_new_tokens=3, stop_token_ids=()))
    ] == out.token_ids


# ---- stop strings: never emitted, held text released or flushed, the finish reason on the last event --
@pytest.fixture(scope="module")
def smol():
    """The real default model (SmolLM2's byte-level BPE tokenizer), where the stop-string leak was seen."""
    from ragkv.model import DEFAULT_MODEL, load_model
    from ragkv.model.registry import ModelFetchError

    try:
        return load_model(DEFAULT_MODEL)
    except ModelFetchError as e:
        pytest.skip(f"default model not available: {e}")


def _feed(model, ids, **params) -> tuple[list[TokenEvent], str | None]:
    """Detokenizer events of ``ids`` until it finishes; each event's text only ever extends the output."""
    det = Detokenizer(model, SamplingParams(**{"max_new_tokens": len(ids), "stop_token_ids": (), **params}))
    events, reason = [], None
    for tok in ids:
        ev, reason = det.accept(tok)
        events.append(ev)
        assert ev.finish_reason == reason and det.text == "".join(e.text for e in events)
        if reason is not None:
            break
    return events, reason


SMOL_TEXT = " Thomas Nabbes wrote of Hannibal and Scipio, café 日本 in 1637."


def test_detokenizer_never_emits_a_stop_string_real_tokenizer(smol):
    ids = smol.encode(SMOL_TEXT)
    full = smol.decode(ids)
    assert full == SMOL_TEXT
    for stop in ("Nabbes", "Scipio", "Hannibal and Sc", "bal and", "日本", "é 日", "1637."):
        assert len(smol.encode(stop)) >= 2  # multi-token
        events, reason = _feed(smol, ids, stop=(stop, "never there"))
        assert reason == "stop" and "".join(e.text for e in events) == full[: full.index(stop)], stop
        assert events[-1].is_token and len(events) < len(ids) + (stop == "1637.")
    # the bug as reported: "...written by Thomas Nab"
    events, _ = _feed(smol, ids, stop=("Nabbes",))
    assert [e.text for e in events] == [" Thomas", " ", ""]


def test_detokenizer_releases_and_flushes_held_text_real_tokenizer(smol):
    ids = smol.encode(SMOL_TEXT)
    full = smol.decode(ids)
    # "Nab" may start "Nabbed": held at " Nab", released when "bes" rules it out
    events, reason = _feed(smol, ids, stop=("Nabbed",))
    assert reason == "length" and "".join(e.text for e in events) == full
    assert [e.text for e in events[:3]] == [" Thomas", " ", "Nabbes"]
    # an incomplete UTF-8 character is never emitted as U+FFFD
    assert all("\ufffd" not in e.text for e in events)
    # the length limit flushes held text: the output is everything decoded
    n = len(smol.encode(" Thomas Nab"))
    events, reason = _feed(smol, ids[:n], stop=("Nabbed",))
    assert (
        reason == "length" and "".join(e.text for e in events) == " Thomas Nab" and events[-1].text == " Nab"
    )
    # so does a stop token: a closing event (no token) carries the held text and the reason
    det = Detokenizer(smol, SamplingParams(max_new_tokens=10, stop=("Nabbed",)))
    assert [det.accept(t)[0].text for t in ids[:n]] == [" Thomas", " "]
    end, reason = det.accept(smol.config.eos_token_ids[0])
    assert (end.token_id, end.text, end.index, end.finish_reason, reason) == (None, "Nab", n, "stop", "stop")
    assert det.text == " Thomas Nab" and det.ids == ids[:n]


def test_detokenizer_byte_fallback_tokenizer():
    m = stories_model()  # sentencepiece with byte fallback: 日 is three byte tokens
    ids = m.encode("Hello café 日本 world.")
    events, reason = _feed(m, ids)
    assert reason == "length" and "".join(e.text for e in events) == "Hello café 日本 world."
    assert all("\ufffd" not in e.text for e in events)
    events, reason = _feed(m, ids, stop=("本 w",))
    assert reason == "stop" and "".join(e.text for e in events) == "Hello café 日"


def _pieces(m, res, n: int) -> list[str]:
    """Per-token texts of the greedy output (no stop strings: nothing is held back)."""
    return [e.text for e in stream(m, res, SamplingParams(max_new_tokens=n))]


def test_stop_strings_multi_token_split_and_on_the_last_token():
    m = stories_model()
    res = prefill(m, m.encode("Once upon a time", add_bos=True), [], [], "full")
    pieces = _pieces(m, res, 30)
    whole = "".join(pieces)
    for stop, n in stop_cases(pieces).values():
        want = whole[: whole.index(stop)]
        for max_new, reason, text in ((30, "stop", want), (n, "stop", want), (n - 1, "length", None)):
            text = "".join(pieces[:max_new]) if text is None else text
            p = SamplingParams(max_new_tokens=max_new, stop=(stop,))
            events = list(stream(m, res, p))
            assert "".join(e.text for e in events) == text and events[-1].finish_reason == reason
            assert all(e.finish_reason is None for e in events[:-1])
            g = generate(m, res, p)
            assert (g.text, g.finish_reason, g.token_ids) == (text, reason, [e.token_id for e in events])


def test_llm_generate_and_stream_stop_strings():
    llm = LLM(stories_model(), self_check_on_load=False)
    args = ("Once upon a time.", ["Lily had a red ball.", "Tom liked to run."], " One day,")
    pieces = [e.text for e in llm.stream(*args, mode="blend", max_new_tokens=24)]
    whole = "".join(pieces)
    for stop, n in stop_cases(pieces).values():
        want = whole[: whole.index(stop)]
        for max_new, reason, text in ((24, "stop", want), (n, "stop", want), (n - 1, "length", None)):
            text = "".join(pieces[:max_new]) if text is None else text
            kw = {"mode": "blend", "max_new_tokens": max_new, "stop": (stop,)}
            events = list(llm.stream(*args, **kw))
            assert "".join(e.text for e in events) == text and events[-1].finish_reason == reason
            a = llm.generate(*args, **kw)
            assert (a.text, a.finish_reason) == (text, reason)


# ---- one request-to-SamplingParams conversion ----------------------------------------------------------
def test_request_params_is_the_one_conversion():
    from ragkv.defaults import DEFAULT_MAX_NEW_TOKENS, MIN_TEMPERATURE
    from ragkv.generate import request_params

    p = request_params()
    assert p == SamplingParams() and p.max_new_tokens == DEFAULT_MAX_NEW_TOKENS and p.temperature == 0.0
    # below the one greedy cut-off: greedy (the server used 1e-3, the sampler 1e-4)
    assert request_params(temperature=MIN_TEMPERATURE / 2).temperature == 0.0
    assert request_params(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    q = request_params(12, None, 0.5, -1, 7, "END", [9], default_temperature=1.0, eos_token_ids=(2, 9))
    assert q == SamplingParams(12, 1.0, 0.5, 0, 7, ("END",), (2, 9))
    assert request_params(stop=["a", "b"], default_max_tokens=16).stop == ("a", "b")
    assert request_params(stop=None).stop_token_ids is None  # the model's EOS


def test_the_answer_is_out_before_the_decode_loop_commits_its_kv():
    """``collect`` hands over the whole answer as soon as the closing event is out; the prefill's
    ``on_finish`` (the KV tree's commit) runs only when the consumer iterates on, so a service sends its
    response first and does that work after (its worker held until it is done)."""
    from ragkv.generate import collect

    m = stories_model()
    res = prefill(m, [], [], m.encode("Once upon a time"), "full")
    calls: list[list[int]] = []
    res.on_finish = lambda answer, wait=True: calls.append(list(answer))
    it = collect(stream(m, res, SamplingParams(max_new_tokens=6, stop_token_ids=())))
    for item in it:
        if isinstance(item, tuple):
            text, ids, reason = item
            break
    assert reason == "length" and len(ids) == 6 and calls == []  # the answer is out, nothing committed yet
    assert list(it) == [] and calls == [ids]  # iterating on ends the loop: the answer committed once
