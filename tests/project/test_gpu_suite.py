"""``scripts/gpu_suite.sh --dry-run``: the one-command GPU run checks its own plumbing without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eval.bench_gpu_suite import BENCH_ARGS, BUDGETS, TOTAL_BUDGET_S, gpu_test_files
from tests.helpers import REPO


@pytest.mark.slow
def test_gpu_suite_dry_run_checks_every_step_and_ends_with_one_json_line(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run(
        [
            "bash",
            str(REPO / "scripts" / "gpu_suite.sh"),
            str(out),
            "--dry-run",
            "--site",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    names = [c["name"] for c in last["checks"]]
    assert names == ["wheels", "env", "tests", *(f"bench_{s}" for s in BENCH_ARGS)]
    assert last["dry_run"] is True and last["ok"] is True
    assert all(c["status"] == "ok" for c in last["checks"]), last["checks"]
    assert last["gpu_tests"] >= 10  # every GPU-marked test was collected (not run)
    assert sum(BUDGETS.values()) <= TOTAL_BUDGET_S < 600  # one GPU command may run 10 minutes
    for section in BENCH_ARGS:
        result = json.loads((out / f"{section}.json").read_text())
        assert result["section"] == section and result["dry_run"] is True
    assert (
        json.loads((out / "summary.json").read_text())["results"]["tests"]["collected"] == last["gpu_tests"]
    )
    assert {
        "tests/unit/blend/test_pipeline_staging.py",
        "tests/unit/eval/test_static_decode.py",
        "tests/unit/store/test_video_codec.py",
        "tests/unit/attention/test_hack.py",
    } <= set(gpu_test_files())


def test_gpu_suite_refuses_a_missing_output_folder():
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_suite.sh")], capture_output=True, text=True)
    assert p.returncode == 2 and "usage" in p.stderr
