"""eval.bench_adapter_time at smoke size: the tiny model, a random adapter file, one question."""

from __future__ import annotations

import torch

from eval import bench_adapter_time
from ragkv.adapter.kv_adapter import KVAdapter
from tests.helpers import stories_model, stories_path


def test_bench_adapter_time_reports_paired_ratios_and_the_correction(tmp_path, one_thread):
    m = stories_model()
    ad = KVAdapter.for_model(m, rank=4)
    with torch.no_grad():
        ad.up_k.normal_(0, 0.1)
    path = tmp_path / "a.safetensors"
    ad.save(path)
    out = bench_adapter_time.main(
        ["--model", str(stories_path()), "--adapter", str(path), "--limit", "1", "--runs", "1"]
        + ["--passage-tokens", "48"]
    )
    assert out["source"] == "pipelined"  # the chunk resolver's default path
    for name in ("reuse", "blend@0.12"):
        lo, hi = out[name]["ci"]
        assert out[name]["ratio"] > 0 and lo - 1e-4 <= out[name]["ratio"] <= hi + 1e-4  # (rounded to 4)
        assert out[name]["ttft_without_ms"] > 0
    assert out["correction_ms"] > 0 and out["correction_rows"] > 0
    assert out["adapter"] == KVAdapter.load(path, m).identity
