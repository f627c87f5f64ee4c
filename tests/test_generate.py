"""Generation after any prefill mode: greedy parity with transformers, sampling, stops, streaming."""

import pytest
import torch

from ragkv import LLM, SamplingParams
from ragkv.blend import prefill
from ragkv.generate import generate, stream
from tests.helpers import stories_model, stories_path


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
