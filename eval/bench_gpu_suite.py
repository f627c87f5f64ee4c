"""One GPU run of at most 10 minutes: install the carried wheels, run every GPU test, run the GPU benchmarks.

Run through ``bash scripts/gpu_suite.sh OUTDIR [--dry-run]`` (stdlib only until the wheels are
installed). Steps, each under its own time budget (their sum stays under :data:`TOTAL_BUDGET_S`):

1. ``wheels``: ``pip install --no-index --no-deps --target SITE .whl/*.whl`` (built by
   ``scripts/gpu_wheels.sh``; extracted with zipfile when the image has no pip); SITE is put on
   PYTHONPATH for every later step.
2. ``env``: what the machine has (GPU, torch, triton, av, PyNvVideoCodec, NVDEC, NVENC) -> env.json.
3. ``tests``: ``pytest -m gpu`` over the test files that hold GPU-marked tests -> gpu_tests.xml/.txt.
4. ``bench_*``: ``python -m eval.bench_gpu SECTION`` for hack, codec, runtime, loading, graph -> SECTION.json.

Every step's outcome goes to summary.json; the run ends with one JSON line whose ``checks`` lists
the steps. ``--dry-run`` checks the plumbing on a machine without a GPU: the wheels (if built) install
into a scratch folder for CPython 3.12 / manylinux x86-64, the GPU tests are collected (not run), and
every benchmark section runs on the CPU at tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: a GPU command may run 600 s; leave room for the machine's own start and transfers
TOTAL_BUDGET_S = 570
#: (step, seconds): the budget of each step, in run order
BUDGETS = {
    "wheels": 60,
    "env": 30,
    "tests": 120,
    "bench_hack": 100,
    "bench_codec": 70,
    "bench_runtime": 60,
    "bench_loading": 50,
    "bench_graph": 80,
}
#: GPU-run arguments per benchmark section (sized to their budgets)
BENCH_ARGS = {
    "hack": ["--runs", "5", "--contexts", "8192,32768,131072", "--batches", "1,16,64"],
    "codec": ["--runs", "3", "--layers", "3", "--chunk-tokens", "2048", "--slots", "64"],
    "runtime": ["--runs", "3", "--layers", "4", "--chunks", "4", "--chunk-tokens", "1536"],
    "loading": ["--runs", "3", "--chunks", "6", "--chunk-tokens", "512"],
    "graph": ["--runs", "3", "--layers", "4", "--new-tokens", "128"],
}
NEEDED_IN_SITE = (
    "av/__init__.py",
    "zstandard/__init__.py",
    "PyNvVideoCodec/__init__.py",
    "PyNvVideoCodec/VersionCheck.cpython-312-x86_64-linux-gnu.so",
    "PyNvVideoCodec/PyNvVideoCodec_130.cpython-312-x86_64-linux-gnu.so",
    "PyNvVideoCodec/libavformat.so.63",
    "PyNvVideoCodec/libavutil.so.61",
)


def gpu_test_files() -> list[str]:
    """Test files holding at least one ``@pytest.mark.gpu`` test (others may import what the image lacks)."""
    return sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")  # tests/unit/<package>, tests/e2e, tests/project
        if "pytest.mark.gpu" in p.read_text()
    )


def run(cmd: list[str], budget: float, env: dict, log: Path | None = None) -> dict:
    """Run ``cmd`` under ``budget`` seconds; returns rc, seconds, timed_out and the output's tail."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(1.0, budget))
        rc, out, timed_out = p.returncode, p.stdout + p.stderr, False
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc, timed_out = 124, True
    if log is not None:
        log.write_text(out)
    return {
        "rc": rc,
        "seconds": round(time.perf_counter() - t0, 2),
        "timed_out": timed_out,
        "tail": out[-1500:],
    }


def install_wheels(wheels: list[Path], site: Path, dry_run: bool, budget: float, env: dict) -> dict:
    """Install the carried wheels into ``site`` (for CPython 3.12 / manylinux when dry-running elsewhere)."""
    if not wheels:
        return {
            "rc": 0 if dry_run else 1,
            "seconds": 0.0,
            "timed_out": False,
            "tail": "no .whl/*.whl: run scripts/gpu_wheels.sh",
        }
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site)]
    if dry_run:
        cmd += ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
                "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
                "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]  # fmt: skip
    res = run([*cmd, *map(str, wheels)], budget, env)
    if res["rc"] != 0 and "No module named pip" in res["tail"]:  # an image without pip: unpack the wheels
        for whl in wheels:
            with zipfile.ZipFile(whl) as z:
                z.extractall(site, [n for n in z.namelist() if not n.split("/", 1)[0].endswith(".data")])
        res = {**res, "rc": 0, "tail": "installed by unzipping (no pip)"}
    missing = [f for f in NEEDED_IN_SITE if not (site / f).exists()]
    if missing:
        res = {**res, "rc": res["rc"] or 1, "missing": missing}
    res["wheels"] = [w.name for w in wheels]
    return res


ENV_PROBE = r"""
import json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.cuda.is_available(),
               gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
except Exception as e:
    out["torch_error"] = repr(e)
for mod in ("triton", "av", "zstandard", "transformers"):
    try:
        out[mod] = __import__(mod).__version__
    except Exception as e:
        out[mod] = f"missing: {type(e).__name__}: {e}"[:200]
try:
    from ragkv.store.codecs.video import nvdec
    out.update(nvdec=nvdec.available(), pynvvideocodec=nvdec.version() or nvdec.IMPORT_ERROR,
               nvdec_min_yuv420=list(nvdec.min_size("yuv420", 8)), nvenc=list(nvdec.nvenc_status()))
except Exception as e:
    out["nvdec_error"] = repr(e)[:300]
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="folder for the JSON results")
    ap.add_argument("--dry-run", action="store_true", help="check the plumbing without a GPU")
    ap.add_argument(
        "--site", default=None, help="where the wheels are installed (default: a fresh temp folder)"
    )
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    assert sum(BUDGETS.values()) <= TOTAL_BUDGET_S
    site = Path(args.site) if args.site else Path(tempfile.mkdtemp(prefix="ragkv-gpu-site-"))
    site.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    # a dry run installs the cp312 wheels only to check them: this interpreter keeps its own packages
    paths = [str(REPO), *([] if args.dry_run else [str(site)]), os.environ.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    wheels = sorted((REPO / ".whl").glob("*.whl"))
    files = gpu_test_files()
    py = sys.executable
    tests_cmd = [py, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider", *files]
    if args.dry_run:
        tests_cmd += ["--collect-only"]
    else:
        tests_cmd += ["--junitxml", str(out / "gpu_tests.xml")]
    checks = [
        {
            "name": "wheels",
            "command": f"pip install --no-index --no-deps --target SITE {' '.join(w.name for w in wheels) or '(none built)'}",
        },
        {"name": "env", "command": "python -c <probe>  -> env.json"},
        {"name": "tests", "command": " ".join(tests_cmd[1:]).replace(str(out), "OUTDIR")},
    ]
    for sec, extra in BENCH_ARGS.items():
        cmd = [
            py,
            "-m",
            "eval.bench_gpu",
            sec,
            "--out",
            str(out),
            *(["--dry-run"] if args.dry_run else extra),
        ]
        checks.append(
            {"name": f"bench_{sec}", "command": " ".join(cmd[1:]).replace(str(out), "OUTDIR"), "argv": cmd}
        )
    results = {}
    for check in checks:
        name = check["name"]
        remaining = TOTAL_BUDGET_S - (time.perf_counter() - t_start)
        budget = min(BUDGETS[name], remaining)
        check["budget_s"] = BUDGETS[name]
        if budget <= 1:
            results[name] = {
                "rc": 124,
                "seconds": 0.0,
                "timed_out": True,
                "tail": "no time left in the suite's budget",
            }
        elif name == "wheels":
            results[name] = install_wheels(wheels, site, args.dry_run, budget, env)
        elif name == "env":
            res = run([py, "-c", ENV_PROBE], budget, env)
            line = res["tail"].strip().splitlines()[-1] if res["tail"].strip() else "{}"
            try:
                res["env"] = json.loads(line)
                (out / "env.json").write_text(json.dumps(res["env"], indent=1))
            except json.JSONDecodeError:
                res["rc"] = res["rc"] or 1
            results[name] = res
        elif name == "tests":
            res = run(tests_cmd, budget, env, out / "gpu_tests.txt")
            m = re.search(r"(\d+)(?:/\d+)? tests? collected", res["tail"])
            counts = {
                k: int(v)
                for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", res["tail"])
            }
            res.update(files=files, counts=counts, collected=int(m.group(1)) if m else None)
            if args.dry_run and res["rc"] == 0 and not res["collected"]:
                res["rc"] = 1  # nothing GPU-marked was collected: the plumbing is broken
            results[name] = res
        else:
            res = run(check.pop("argv"), budget, env, out / f"{name}.log")
            res["json"] = (out / f"{name.removeprefix('bench_')}.json").exists()
            if res["rc"] == 0 and not res["json"]:
                res["rc"] = 1
            results[name] = res
        check.pop("argv", None)
        check["status"] = (
            "ok" if results[name]["rc"] == 0 else ("timeout" if results[name]["timed_out"] else "failed")
        )
        print(
            f"[gpu_suite] {name}: {check['status']} in {results[name]['seconds']} s",
            file=sys.stderr,
            flush=True,
        )
    summary = {
        "suite": "gpu",
        "dry_run": args.dry_run,
        "ok": all(r["rc"] == 0 for r in results.values()),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "budget_s": TOTAL_BUDGET_S,
        "out": str(out),
        "gpu_tests": results["tests"].get("collected") if args.dry_run else results["tests"].get("counts"),
        "checks": checks,
    }
    (out / "summary.json").write_text(json.dumps({**summary, "results": results}, indent=1))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
