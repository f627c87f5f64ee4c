"""eval.gpu_train_writer's device-call-1 check at CPU size: the writer's training path, then its KV
blended (what it runs on CUDA before the second call trains)."""

from __future__ import annotations

from eval.gpu_train_writer import smoke


def test_the_smoke_check_trains_a_writer_and_blends_its_kv(tmp_path):
    res = smoke("cpu", tmp_path)
    assert res["smoke_ok"] and res["smoke_loss"] > 0 and res["device"] == "cpu"
    assert not list(tmp_path.glob("smoke*"))  # its files are removed
