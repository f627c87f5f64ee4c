"""Structured output and log-probabilities in the one sampling step (``Detokenizer.step``), on real
tokenizers and models: the JSON-schema constraint's masks (teacher-forced documents pass, stop tokens
only where the JSON is complete), constrained generation (valid JSON of the schema whenever it
finishes with "stop"; "length" when cut), refused schemas, and logprobs equal to the model's
log-softmax, alike in ``generate.stream`` and the batching engine."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from eval.bench_structured import schema_set  # noqa: E402  (the 10 schemas: one list, the benchmark's)
from ragkv.blend import prefill  # noqa: E402
from ragkv.constrain import ConstraintError, close_objects, json_constraint, ll_tokenizer  # noqa: E402
from ragkv.engine import Engine, EngineConfig  # noqa: E402
from ragkv.generate import SamplingParams, continuation_nll, generate, stream  # noqa: E402
from tests.helpers import stories_model  # noqa: E402

SEPARATORS = (", ", ": ")


def check_output(text: str, schema: dict) -> dict:
    """``text`` parsed, after checking it is JSON matching ``schema``."""
    obj = json.loads(text)
    jsonschema.validate(obj, schema)
    return obj


@pytest.fixture(scope="module")
def model():
    return stories_model()


@pytest.fixture(scope="module")
def prompt(model):
    return prefill(model, model.encode("Once upon a time", add_bos=True), [], [], "full")


def _forced(model, schema: dict, ids: list[int]) -> tuple[list[torch.Tensor], object]:
    """The masks of a constraint of ``schema`` along ``ids`` (each checked to allow its token)."""
    state = json_constraint(schema).start(model)
    stops = frozenset(model.config.eos_token_ids)
    masks = []
    for tok in ids:
        ok = state.allowed(stops)
        assert ok[tok], (schema, tok)
        assert not ok[list(stops)].any(), "a stop token before the JSON is complete"
        masks.append(ok)
        state.advance(tok)
    return masks, state


@pytest.mark.parametrize("case", schema_set(), ids=lambda c: c["name"])
def test_example_documents_pass_the_mask_and_then_only_stop_tokens(model, case):
    text = json.dumps(case["example"], separators=SEPARATORS)
    ids = ll_tokenizer(model).tokenize_str(text)
    _, state = _forced(model, case["schema"], ids)
    assert state.complete
    stops = frozenset(model.config.eos_token_ids)
    ok = state.allowed(stops)
    assert ok.nonzero().flatten().tolist() == sorted(stops)


def test_a_document_off_the_schema_is_masked(model):
    schema = schema_set()[0]["schema"]  # {"name": str, "age": int}
    state = json_constraint(schema).start(model)
    for tok in ll_tokenizer(model).tokenize_str('{"name": "Ada", "age": '):
        state.advance(tok)
    ok = state.allowed(frozenset())
    digits = {t for t in range(model.config.vocab_size) if model.decode([t]).strip().isdigit()}
    quote = ll_tokenizer(model).tokenize_str('"')
    assert digits and all(ok[t] for t in digits) and not ok[quote[0]]


@pytest.mark.parametrize(
    "schema, why",
    [
        ([1, 2], "must be a JSON object"),
        ({"type": "objectx"}, "objectx"),
        ({"type": "string", "pattern": "(("}, "unclosed group"),
        ({"type": "string", "format": "no-such-format"}, "no-such-format"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ],
)
def test_invalid_or_unsupported_schemas_are_refused(schema, why):
    with pytest.raises(ConstraintError, match=why):
        json_constraint(schema)


def test_objects_with_properties_get_no_other_keys():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
        "$defs": {"X": {"properties": {"c": {}}, "additionalProperties": True}},
        "anyOf": [{"properties": {"d": {}}}, {"type": "object"}],
        "allOf": [{"properties": {"e": {}}}],
    }
    out = close_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["$defs"]["X"]["additionalProperties"] is True  # said: kept
    assert out["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in out["anyOf"][1]
    assert "additionalProperties" not in out["allOf"][0]  # each part lists only some keys
    assert "additionalProperties" not in schema  # the caller's schema is not changed


@pytest.mark.slow  # ~10 s: 40 generations
def test_constrained_generation_is_valid_json_of_the_schema_whenever_it_stops(model, prompt):
    """Every schema, greedy and sampled: "stop" only with valid JSON of the schema, else "length" at the
    limit. The 260K-parameter story model often rambles (numbers of endless zeros); most still close."""
    stopped = 0
    for case in schema_set():
        con = json_constraint(case["schema"])
        for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
            params = SamplingParams(max_new_tokens=120, temperature=temperature, seed=seed, constraint=con)
            g = generate(model, prompt, params)
            if g.finish_reason == "stop":
                check_output(g.text, case["schema"])
                stopped += 1
            else:
                assert g.finish_reason == "length" and len(g.token_ids) == 120, (case["name"], g)
        cut = generate(model, prompt, SamplingParams(max_new_tokens=3, constraint=con))
        assert cut.finish_reason == "length" and len(cut.token_ids) == 3 and cut.text.startswith("{")
    assert stopped >= 15, f"only {stopped} of 30 constrained generations closed their JSON"


def test_without_stop_tokens_a_complete_json_ends_the_generation(model, prompt):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    params = SamplingParams(max_new_tokens=50, stop_token_ids=(), constraint=json_constraint(schema))
    g = generate(model, prompt, params)
    assert g.finish_reason == "stop" and json.loads(g.text) in ({"ok": True}, {"ok": False})


def test_stop_token_ids_end_a_constrained_generation_only_where_the_json_is_complete(model, prompt):
    """A stop token the grammar allows mid-JSON (here ``e``) is held back until the JSON is whole; one
    that is the only way on (``"`` after ``{``) is an error, not a cut JSON."""
    llt = ll_tokenizer(model)
    e, quote = llt.tokenize_str("e")[0], llt.tokenize_str('"')[0]
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}, "required": ["s"]}
    con = json_constraint(schema)
    stops = (*model.config.eos_token_ids, e)
    g = generate(model, prompt, SamplingParams(max_new_tokens=60, stop_token_ids=stops, constraint=con))
    assert g.finish_reason == "stop" and e not in g.token_ids
    check_output(g.text, schema)
    with pytest.raises(ConstraintError, match="no token can continue"):
        generate(model, prompt, SamplingParams(max_new_tokens=60, stop_token_ids=(quote,), constraint=con))


def test_stop_strings_cannot_be_combined_with_a_constraint():
    with pytest.raises(ValueError, match="stop strings"):
        SamplingParams(stop=("}",), constraint=json_constraint())
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_logprobs_are_the_models_log_softmax(model, prompt):
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(), logprobs=3)
    events = list(stream(model, prompt, params))
    ids = [e.token_id for e in events]
    nll = continuation_nll(model, prompt, ids)
    for e, n in zip(events, nll, strict=True):
        assert e.logprob == pytest.approx(-n, abs=1e-4)
        top = e.top_logprobs
        assert len(top) == 3 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert top[0][0] == e.token_id and top[0][1] == pytest.approx(e.logprob)  # greedy: the top one
    plain = list(stream(model, prompt, SamplingParams(max_new_tokens=12, stop_token_ids=())))
    assert [e.token_id for e in plain] == ids and all(e.logprob is None for e in plain)
    zero = next(stream(model, prompt, SamplingParams(max_new_tokens=1, logprobs=0)))
    assert zero.logprob is not None and zero.top_logprobs == ()


def test_constrained_logprobs_are_the_unmasked_models(model, prompt):
    """Under a constraint the chosen token is the best allowed one; its logprob is still the model's."""
    con = json_constraint({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    events = [
        e
        for e in stream(model, prompt, SamplingParams(max_new_tokens=8, constraint=con, logprobs=1))
        if e.is_token
    ]
    nll = continuation_nll(model, prompt, [e.token_id for e in events])
    assert [e.logprob for e in events] == pytest.approx([-n for n in nll], abs=1e-4)
    assert events[0].token_id != events[0].top_logprobs[0][0]  # the model wanted a story, not "{"


def test_the_engine_constrains_and_reports_logprobs_like_generate(model, prompt):
    """Constrained, logprob and plain requests batched together: each as generate() alone gives it."""
    cases = [c for c in schema_set() if c["name"] in ("answer", "address", "rating")]  # greedy: they close
    reqs = []
    for i, case in enumerate(cases):
        params = SamplingParams(max_new_tokens=110, constraint=json_constraint(case["schema"]), logprobs=i)
        reqs.append(
            dict(
                prefix=[model.config.bos_token_id],
                chunks=[],
                question=model.encode("Once upon a time"),
                params=params,
            )
        )
    reqs.append(
        dict(
            prefix=[model.config.bos_token_id],
            chunks=[],
            question=model.encode("Lily saw"),
            params=SamplingParams(max_new_tokens=20),
        )
    )
    with Engine(model, EngineConfig(num_blocks=200)) as eng:
        handles = [eng.submit(**r) for r in reqs]
        streams = [list(h.stream()) for h in handles]
    for r, evs in zip(reqs, streams, strict=True):
        res = prefill(model, r["prefix"], [], r["question"], "full")
        ref = list(stream(model, res, r["params"]))
        assert [(e.token_id, e.text, e.finish_reason) for e in evs] == [
            (e.token_id, e.text, e.finish_reason) for e in ref
        ]
        assert (
            [e.logprob for e in evs] == pytest.approx([e.logprob for e in ref], abs=1e-4)
            if r["params"].logprobs is not None
            else True
        )
    for case, evs in zip(cases, streams, strict=False):
        assert evs[-1].finish_reason == "stop"
        check_output("".join(e.text for e in evs), case["schema"])


@pytest.mark.slow
def test_real_tokenizer_masks_pass_every_example_document():
    """SmolLM2's byte-level BPE: each example, tokenized as the model's tokenizer does, passes the masks."""
    from ragkv.model import DEFAULT_MODEL, load_model
    from ragkv.model.registry import ModelFetchError

    try:
        smol = load_model(DEFAULT_MODEL)
    except ModelFetchError as e:
        pytest.skip(f"default model not available: {e}")
    for case in schema_set():
        text = json.dumps(case["example"], separators=SEPARATORS)
        _, state = _forced(smol, case["schema"], smol.tokenizer.encode(text, add_special_tokens=False))
        assert state.complete, case["name"]
