#!/usr/bin/env bash
# Set up (idempotent) and run the test suite at two CPU kernel levels: the core's tests/ and the tests/ of
# each distribution of this repository (apps/, integrations/*; pyproject.toml's testpaths).
#
# torch picks its CPU kernels at run time (AVX-512 or AVX2 on x86), and low-precision results can
# depend on which: a bf16 sum in another order, a near-tied greedy token. The project's machines have
# either level, so a test must hold on both. When this machine's native level is above AVX2, the fast
# tier (-m "not slow": everything but the long end-to-end process/server tests) runs first with AVX2
# kernels (ATen, and MKL / oneDNN capped alike, as on an AVX2-only machine), then the whole suite at
# the native level; otherwise the whole suite runs once. The first failing run stops the script with
# its exit status, and the output ends with that run's pytest summary line. Both runs use pytest-xdist
# workers, whole test files to a worker (module fixtures: servers, models): RAGKV_TEST_WORKERS (default
# 2; 0 runs in this process); arguments given here come after, so a caller's own -n wins.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Byte code is cached: pytest rewrites the asserts of every module of its plugins' distributions
# (langsmith, schemathesis, hypothesis...: ~630 modules, ~10 s per process on 2 cores) and caches the
# result only where Python may write .pyc files; an environment with PYTHONDONTWRITEBYTECODE set (some
# images set it) would pay that in every pytest worker and the project's sources in every server start.
unset PYTHONDONTWRITEBYTECODE
workers=(-n "${RAGKV_TEST_WORKERS:-2}" --dist loadfile)
# the core and every distribution (apps/, integrations/): one lint, one pytest run over all their tests
# (pyproject.toml's testpaths: tests/ and each distribution's tests/)
ruff check ragkv eval tests apps integrations
ruff format --check ragkv eval tests apps integrations
# honours an ATEN_CPU_CAPABILITY already set by the caller (=avx2 gives one AVX2 run)
native="$(python -W ignore -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')"
case "$native" in
  AVX512*)
    echo "== fast tier with AVX2 kernels (native level: $native)"
    rc=0
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
      python -m pytest -q "${workers[@]}" -m "not slow" "$@" || rc=$?
    # 5: the caller's selection holds only slow tests, which the native run below covers
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
      exit "$rc"
    fi
    echo "== whole suite with native $native kernels"
    ;;
  *)
    echo "== whole suite with $native kernels (not AVX-512: no lower level to check)"
    ;;
esac
exec python -m pytest -q "${workers[@]}" "$@"
