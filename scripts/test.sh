#!/usr/bin/env bash
# Set up (idempotent) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
ruff check ragkv integrations apps eval tests
ruff format --check ragkv integrations apps eval tests
exec python -m pytest -q "$@"
