"""Constrained decoding libraries on this model's vocabulary: the cost of a JSON-schema token mask.

For each library that imports here (llguidance, xgrammar, outlines-core) and each schema of
``data/structured_schemas.json``: the one-time tokenizer set-up, the per-request grammar compile,
and per generated token the library's mask fill plus the (shared) masking of fp32 logits, teacher-
forced along the schema's example document (best of ``--repeats`` passes per item: the machine is
shared). With ``--generate`` it also times ragkv's own
constrained greedy generation (:mod:`ragkv.constrain`) against unconstrained decoding. Ends with
one JSON line.

    python -m eval.bench_structured [--model smollm2-135m-instruct] [--generate]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable

import torch

from ragkv.testing import structured_schemas

SEPARATORS = (", ", ": ")


def schema_set() -> list[dict]:
    """The 10 schemas (name, prompt, schema, example) the structured-output tests use too."""
    return structured_schemas()


def allowed_of(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bool ``[vocab]`` mask of an int32 token bitmask (bit ``i % 32`` of word ``i // 32``)."""
    bits = bitmask.view(torch.uint8).unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)
    return (bits & 1).bool().flatten()[:vocab]


class Backend:
    """One library behind a common face: ``compile(schema) -> matcher``, ``fill(matcher, bitmask)``,
    ``consume(matcher, token)``."""

    name = ""
    compile: Callable
    fill: Callable
    consume: Callable


def llguidance_backend(tokenizer, vocab: int) -> Backend:
    import llguidance
    import llguidance.hf

    b = Backend()
    b.name = "llguidance " + _version("llguidance")
    llt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    opts = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}

    def compile_(schema):
        m = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=opts))
        assert not m.is_error(), m.get_error()
        return m

    def fill(m, bm):
        m.unsafe_compute_mask_ptr(bm.data_ptr(), bm.numel() * 4)

    b.compile, b.fill, b.consume = compile_, fill, lambda m, t: m.consume_token(t)
    return b


def xgrammar_backend(tokenizer, vocab: int) -> Backend:
    import xgrammar as xgr

    b = Backend()
    b.name = "xgrammar " + _version("xgrammar")
    # its compile cache on, as a server runs it: parts shared across schemas are compiled once (with
    # cache_enabled=False every compile here took 0.3-1 s); the first compile of each schema is timed
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))

    def compile_(schema):
        g = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS)
        return xgr.GrammarMatcher(g)

    b.compile = compile_
    b.fill = lambda m, bm: m.fill_next_token_bitmask(bm.view(1, -1))
    b.consume = lambda m, t: m.accept_token(t)
    return b


def outlines_backend(tokenizer, vocab: int) -> Backend:
    import llguidance.hf  # only to read every token's bytes (outlines' own from_pretrained goes to the hub)
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    b = Backend()
    b.name = "outlines-core " + _version("outlines_core")
    llt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    eos = llt.eos_token
    tokens: dict[str, list[int]] = {}
    for i in range(vocab):
        raw = llt.decode_bytes([i])
        if i != eos and raw and not llt.is_special_token(i):
            try:
                tokens.setdefault(raw.decode("utf-8"), []).append(i)
            except UnicodeDecodeError:
                pass  # a partial UTF-8 token: outlines-core's Vocabulary takes strings
    voc = outlines_core.Vocabulary(eos, tokens)

    def compile_(schema):
        return outlines_core.Guide(outlines_core.Index(build_regex_from_schema(json.dumps(schema)), voc))

    b.compile = compile_
    b.fill = lambda g, bm: g.write_mask_into(bm.data_ptr(), bm.numel(), 4)
    b.consume = lambda g, t: g.advance(t)
    return b


BACKENDS = {"llguidance": llguidance_backend, "xgrammar": xgrammar_backend, "outlines_core": outlines_backend}


def _version(module: str) -> str:
    from importlib.metadata import version

    return version(module.replace("_", "-"))


def bench_backend(name: str, tokenizer, vocab: int, schemas: list[dict], repeats: int = 3) -> dict:
    """Set-up, compile and per-token mask times of one library over every schema's example: a
    schema's compile is its first (a request's schema is new; later ones may hit a cache), each
    token's fill / apply the best of ``repeats`` passes (a shared machine's preemptions removed);
    the median / p99 / max over schemas or tokens is reported."""
    t0 = time.perf_counter()
    b = BACKENDS[name](tokenizer, vocab)
    setup = time.perf_counter() - t0
    bm = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    logits = torch.randn(vocab)
    docs = [
        (s, tokenizer.encode(json.dumps(s["example"], separators=SEPARATORS), add_special_tokens=False))
        for s in schemas
    ]
    compiles: list[float] = []
    fills = [float("inf")] * sum(len(ids) for _, ids in docs)
    applies = list(fills)
    for r in range(repeats):
        k = 0
        for s, ids in docs:
            t0 = time.perf_counter()
            m = b.compile(s["schema"])
            if r == 0:
                compiles.append(time.perf_counter() - t0)
            for tok in ids:
                t0 = time.perf_counter()
                b.fill(m, bm)
                t1 = time.perf_counter()
                lg = logits.masked_fill(~allowed_of(bm, vocab), float("-inf"))
                t2 = time.perf_counter()
                fills[k], applies[k] = min(fills[k], t1 - t0), min(applies[k], t2 - t1)
                k += 1
                assert lg[tok] > float("-inf"), f"{b.name}: {s['name']}: token {tok} masked out"
                b.consume(m, tok)
    us = 1e6
    return {
        "library": b.name,
        "setup_s": round(setup, 3),
        "compile_ms_median": round(statistics.median(compiles) * 1e3, 2),
        "compile_ms_max": round(max(compiles) * 1e3, 2),
        "tokens": len(fills),
        "fill_us_median": round(statistics.median(fills) * us, 1),
        "fill_us_p99": round(sorted(fills)[int(0.99 * (len(fills) - 1))] * us, 1),
        "fill_us_max": round(max(fills) * us, 1),
        "apply_us_median": round(statistics.median(applies) * us, 1),
    }


def bench_generate(model, schemas: list[dict], max_new: int, repeats: int = 2) -> dict:
    """ragkv's constrained greedy generation (``SamplingParams.constraint``) against unconstrained
    decoding of as many tokens after the same prompt: time per output token (best of ``repeats``,
    alternated) and how many outputs stop with valid JSON."""
    from ragkv.blend import prefill
    from ragkv.constrain import json_constraint
    from ragkv.generate import SamplingParams, generate
    from ragkv.model.chat import chat_parts

    plain, constrained, valid, stopped = [], [], 0, 0
    for s in schemas:
        head, tail = chat_parts(model, s["prompt"], "")
        res = prefill(model, head, [], tail, "full")
        params = SamplingParams(max_new_tokens=max_new, constraint=json_constraint(s["schema"]))
        best_c = best_p = float("inf")
        for _ in range(repeats):
            g = generate(model, res, params)
            best_c = min(best_c, g.timings["tpot_s"])
            same_length = SamplingParams(max_new_tokens=len(g.token_ids), stop_token_ids=())
            best_p = min(best_p, generate(model, res, same_length).timings["tpot_s"])
        plain.append(best_p)
        constrained.append(best_c)
        print(f"  {s['name']}: {g.finish_reason}, {len(g.token_ids)} tokens: {g.text}")
        stopped += g.finish_reason == "stop"
        try:
            json.loads(g.text)
            valid += 1
        except ValueError:
            pass
    return {
        "plain_ms_per_token": round(statistics.median(plain) * 1e3, 2),
        "constrained_ms_per_token": round(statistics.median(constrained) * 1e3, 2),
        "overhead_median": round(
            statistics.median(c / p - 1 for c, p in zip(constrained, plain, strict=True)), 4
        ),
        "finished_stop": stopped,
        "valid_json": valid,
        "schemas": len(schemas),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: ragkv's default model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--generate", action="store_true", help="also time ragkv's constrained generation")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3, help="passes per library (best of, per item)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from ragkv.model import DEFAULT_MODEL, load_model

    model = load_model(args.model or DEFAULT_MODEL)
    vocab = model.config.vocab_size
    schemas = schema_set()
    out: dict = {"model": args.model or DEFAULT_MODEL, "vocab": vocab, "libraries": []}
    for name in BACKENDS:
        if importlib.util.find_spec(name) is None:
            print(f"{name}: not installed")
            continue
        row = bench_backend(name, model.tokenizer, vocab, schemas, args.repeats)
        print(row)
        out["libraries"].append(row)
    if args.generate:
        out["generate"] = bench_generate(model, schemas, args.max_new_tokens, max(1, args.repeats - 1))
        print(out["generate"])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
