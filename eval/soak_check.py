"""The soak's checks, run on its history after the run: documents, answers, errors, latency.

* every acknowledged document is listed and retrievable, no deleted one is listed, and no answer cites
  a document that was deleted for the whole of its request (:func:`check_documents`, :func:`deleted_served`);
* every served exact answer equals full prefill's greedy answer for its served prompt ids, recomputed
  here with ragkv's own model in ``mode="full"`` (:func:`check_answers`);
* every error is a clean JSON error with an expected status, and no request outlived its deadline
  unless the service was killed under it (:func:`check_errors`);
* TTFT's p99 outside the faults' windows against the quiet phase's (:func:`ttft_figures`).
"""

from __future__ import annotations

import random
from collections import Counter

import httpx

#: statuses a request may get under load and faults: busy (429), a queue deadline or shutdown (503),
#: the data folder's disk full (507); 404 only for a delete of a document that is not there
EXPECTED_STATUSES = {429, 503, 507}
#: the error type (code, in an OpenAI error chunk) of a 500: an unexpected exception
INTERNAL = "internal_error"
#: after a fault's window, latencies count as the fault's for this long (a restarted service warms up)
SETTLE_S = 5.0


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def check_documents(base: str, ledger, max_tokens: int = 1) -> dict:
    """Listed vs acknowledged documents, and each acknowledged one found by a query with its own text."""
    with httpx.Client(base_url=base, timeout=120) as c:
        listed = set(c.get("/v1/documents").json()["ids"])
        present = {d for d, s in ledger.state.items() if s.state == "present"}
        absent = {d for d, s in ledger.state.items() if s.state == "absent"}
        unretrievable = []
        for d in sorted(present & listed):
            q = {"question": ledger.docs[d]["text"][:200], "top_k": 3, "max_tokens": max_tokens}
            r = c.post("/v1/query", json=q)
            if r.status_code != 200 or d not in {s["doc_id"] for s in r.json()["sources"]}:
                unretrievable.append(d)
    return {
        "documents_acknowledged": len(present),
        "documents_unknown": sum(s.state == "unknown" for s in ledger.state.values()),
        "acknowledged_lost": sorted(present - listed),
        "deleted_listed": sorted(absent & listed),
        "unretrievable": unretrievable,
    }


def deleted_served(records: list[dict], ledger) -> list[dict]:
    """Answers whose sources include a document known deleted for the whole of the request."""
    return [
        r
        for r in records
        if any(ledger.absent_throughout(d, r["t0"], r["t1"]) for d in r.get("sources") or ())
    ]


def _whole(r: dict) -> bool:
    """A whole answer with its token ids (a stream that ended with ``[DONE]``)."""
    whole = r.get("status") == 200 and "error" not in r and r.get("token_ids") is not None
    return bool(whole and (r.get("done") or not r.get("stream")))


def _checkable(r: dict) -> bool:
    """A whole greedy answer of the exact setting with its served prompt (ids, or a completion's text)."""
    return _whole(r) and r.get("mode") in ("prefix", "full") and bool(r.get("prompt_ids") or r.get("prompt"))


def check_answers(records: list[dict], model, limit: int | None, seed: int) -> dict:
    """Recompute each served exact answer with full prefill (greedy, the request's ``max_tokens``) and
    compare token ids. ``model``: a model folder (None: the default model) or a ``ragkv.LLM``. Identical prompts are computed once; ``limit``: at most that many distinct
    prompts (a seeded sample)."""
    import torch

    from ragkv import LLM
    from ragkv.model import DEFAULT_MODEL

    torch.set_num_threads(1)  # the service's thread count (float results depend on it)
    llm = LLM(model or DEFAULT_MODEL) if isinstance(model, str | None) else model
    todo = [r for r in records if _checkable(r)]
    skipped_modes = Counter(str(r.get("mode")) for r in records if _whole(r) and not _checkable(r))
    groups: dict[tuple, list[dict]] = {}
    for r in todo:
        ids = r.get("prompt_ids") or llm.model.encode(r["prompt"], add_bos=True, specials=True)
        groups.setdefault((tuple(ids), r["max_tokens"]), []).append(r)
    keys = sorted(groups)
    if limit is not None and len(keys) > limit:
        keys = random.Random(seed).sample(keys, limit)
    wrong = []
    checked = 0
    for ids, n in keys:
        want = llm.generate(list(ids), [], [], mode="full", max_new_tokens=n, temperature=0.0).token_ids
        for r in groups[(ids, n)]:
            checked += 1
            if list(r["token_ids"]) != list(want):
                wrong.append({"op": r["op"], "t0": r["t0"], "served": r["token_ids"], "full": want})
    return {
        "answers_checked": checked,
        "distinct_prompts_checked": len(keys),
        "wrong_answers": wrong,
        "answers_not_exact_mode": dict(skipped_modes),
    }


def _in(t0: float, t1: float, windows: list[tuple[float, float]]) -> bool:
    return any(t0 <= b and a <= t1 for a, b in windows)


def _clean(err) -> bool:
    return isinstance(err, dict) and isinstance(err.get("message"), str) and bool(err.get("type"))


def check_errors(records: list[dict], kills: list[tuple[float, float]]) -> dict:
    """Count unclean errors (no JSON error object, or an unexpected status), hangs (a deadline passed
    with the service up) and transport errors outside a kill (the service was up and did not answer)."""
    statuses = Counter(str(r.get("status") or r.get("transport", "bug")) for r in records)
    unclean, hangs, dropped, stream_errors = [], [], [], []
    for r in records:
        if "bug" in r:
            unclean.append(r)
            continue
        during_kill = _in(r["t0"], r["t1"], kills)
        if "transport" in r:
            if r["transport"].startswith("timeout") and not during_kill:
                hangs.append(r)
            elif not during_kill:
                dropped.append(r)
            continue
        status = r["status"]
        if status == 200:
            if "error" in r:  # an error after the stream's headers: an error chunk
                stream_errors.append(r)
                if not _clean(r["error"]) or INTERNAL in (r["error"].get("code"), r["error"].get("type")):
                    unclean.append(r)  # a 500 after the headers: OpenAI's server_error, code internal_error
            elif r.get("stream") and not r.get("done") and not during_kill:
                dropped.append(r)  # a stream that ended without [DONE]
            continue
        expected = status in EXPECTED_STATUSES or (status == 404 and r["op"] == "delete")
        if not expected or not _clean(r.get("error")):
            unclean.append(r)
    return {
        "statuses": dict(statuses),
        "unclean_errors": [_short(r) for r in unclean],
        "hangs": [_short(r) for r in hangs],
        "dropped_while_up": [_short(r) for r in dropped],
        "stream_errors": len(stream_errors),
    }


def _short(r: dict) -> dict:
    keys = ("op", "t0", "t1", "status", "transport", "error", "body", "bug")
    return {k: r[k] for k in keys if k in r}


def ttft_figures(records: list[dict], quiet_end: float, windows: list[tuple[float, float]]) -> dict:
    """p50 / p99 time to first token (streamed requests: the first text) in the quiet phase and in the
    fault phase outside every fault's window (+ :data:`SETTLE_S`)."""
    settled = [(a, b + SETTLE_S) for a, b in windows]
    streamed = [r for r in records if r.get("stream") and r.get("done") and "ttft" in r and "error" not in r]
    quiet = [r["ttft"] for r in streamed if r["t1"] <= quiet_end]
    calm = [r["ttft"] for r in streamed if r["t0"] > quiet_end and not _in(r["t0"], r["t1"], settled)]
    q99, c99 = percentile(quiet, 99), percentile(calm, 99)
    ms = lambda x: None if x is None else round(1000 * x, 1)  # noqa: E731
    return {
        "ttft_quiet_n": len(quiet),
        "ttft_quiet_p50_ms": ms(percentile(quiet, 50)),
        "ttft_quiet_p99_ms": ms(q99),
        "ttft_outside_faults_n": len(calm),
        "ttft_outside_faults_p50_ms": ms(percentile(calm, 50)),
        "ttft_outside_faults_p99_ms": ms(c99),
        "ttft_p99_ratio": round(c99 / q99, 2) if q99 and c99 else None,
    }
