#!/usr/bin/env bash
# One GPU run (<= 10 minutes): install the wheels carried in .whl/ (built by scripts/gpu_wheels.sh) into a
# scratch site dir put on PYTHONPATH, run every GPU-marked test, run the GPU benchmarks; JSON results go
# to OUTDIR (one file per benchmark, env.json, summary.json) and the run ends with one JSON line whose
# "checks" lists the steps. --dry-run checks the same plumbing on a machine without a GPU.
#   usage: bash scripts/gpu_suite.sh OUTDIR [--dry-run]
# On a GPU machine: carry .whl (run tool: carry [".whl"]) and run `bash scripts/gpu_suite.sh $OUT`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bash scripts/gpu_suite.sh OUTDIR [--dry-run]" >&2
  exit 2
fi
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" -m eval.bench_gpu_suite "$@"
