"""eval.bench_adapter's ingest-cost measurement at smoke size (the tiny model, two prompts)."""

from __future__ import annotations

from eval.bench_adapter import ingest_cost
from ragkv.adapter.data import Item
from tests.helpers import stories_model


def test_ingest_cost_times_each_distinct_chunk_after_bos_and_after_the_cached_context(one_thread):
    m = stories_model()
    items = [
        Item("continue", ["Tom had a red ball.", "Lily saw a big dog."], None, suffix_text="One day", id="a"),
        Item("continue", ["Lily saw a big dog.", "The sun was hot."], None, suffix_text="Then", id="b"),
    ]
    context = m.encode("Once upon a time there was a cat who liked to sleep in the sun all day long.")
    res = ingest_cost(m, items, context, runs=1)
    assert res["chunks"] == 3  # the passage the two prompts share is timed once
    assert res["context_tokens"] == len(context)
    assert res["iso_ms_median"] > 0 and res["fixed_ms_median"] > 0
    lo, hi = res["ratio_ci"]
    assert res["ratio_median"] > 0 and lo <= hi
