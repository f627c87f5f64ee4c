#!/usr/bin/env bash
# Build a throwaway CPU venv in which the real vLLM (0.32 or 0.33) imports, and run the vLLM contract tests
# (integrations/vllm/tests: test_vllm_plugin.py, test_vllm_hack.py) and the paged HACK tests in it.
# vLLM 0.33.0 does not resolve with pip's resolver here (it pins certifi>=2026.10.19 and torch==2.14), but
# the wheel installs with --no-deps like 0.32's: VLLM_SPEC=vllm==0.33.0 VENV=/tmp/ragkv-vllm-033 <this script>.
# (0.33 then runs on torch 2.13 CPU, which its Python code imports fine; its CUDA kernels are never loaded.)
#
# vLLM's PyPI wheel is the CUDA build and pins torch==2.13.0; installed with --no-deps next to a CPU
# torch 2.13.0, plus the pure-Python packages its imports need, it imports and builds models on its
# CPU platform (VLLM_TARGET_DEVICE=cpu), which is all the contract tests need. No GPU, no CUDA kernels.
# Downloads: the vLLM wheel (~330 MB) and ~100 MB of small packages; torch from TORCH_SPEC.
#
#   VENV        [/tmp/ragkv-vllm-contract]   where to build it (delete it afterwards)
#   TORCH_SPEC  [torch==2.13.0+cpu]          found via pip's configured indexes / find-links
#   TORCH_INDEX []                           e.g. https://download.pytorch.org/whl/cpu where torch+cpu is not local
#   VLLM_SPEC   [vllm==0.32.0]
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
VENV=${VENV:-/tmp/ragkv-vllm-contract}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
VLLM_SPEC=${VLLM_SPEC:-vllm==0.32.0}

python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q)
if [ -n "${TORCH_INDEX:-}" ]; then
  "${PIP[@]}" "$TORCH_SPEC" --extra-index-url "$TORCH_INDEX"
else
  "${PIP[@]}" "$TORCH_SPEC"
fi
# vLLM and the few of its pins that must not pull their own torch / CUDA packages: no dependencies
"${PIP[@]}" --no-deps "$VLLM_SPEC" "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11" "compressed-tensors==0.17.0" loguru
# what `import vllm`, its configs, scheduler, model loader and OpenAI protocol import (pure Python / CPU wheels)
"${PIP[@]}" numpy "transformers>=5.16.1,<5.20" "tokenizers>=0.23.2" "safetensors>=0.6.2" "huggingface_hub>=1.31" \
  pydantic msgspec cloudpickle psutil pyzmq regex cachetools blake3 py-cpuinfo pyyaml requests tqdm sentencepiece \
  "protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*" prometheus_client "openai>=2.25" "fastapi[standard]>=0.133,<0.137" \
  aiohttp einops cbor2 pybase64 setproctitle partial-json-parser python-json-logger ijson pillow zstandard \
  "oss-harmony>=0.0.11" "mistral_common[image]>=1.11.6" "mcp>=2,<3" "anthropic>=0.71" tiktoken \
  "lm-format-enforcer==0.11.3" "llguidance>=1.7,<1.8" "outlines_core==0.2.14" "lark==1.2.2" jsonschema \
  "depyf==0.20.0" ninja "opentelemetry-sdk>=1.27" "opentelemetry-api>=1.27" "opentelemetry-exporter-otlp>=1.27" \
  "opentelemetry-semantic-conventions-ai>=0.4.1" "model-hosting-container-standards>=0.1.14,<1" \
  "prometheus-fastapi-instrumentator>=8" pytest hypothesis
"$VENV/bin/python" - <<'PY'
import torch, vllm
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print("vllm", vllm.__version__, "torch", torch.__version__)
PY
cd "$REPO"
PYTHONPATH="$REPO:$REPO/integrations/vllm" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs \
  integrations/vllm/tests/test_vllm_plugin.py integrations/vllm/tests/test_vllm_hack.py tests/unit/attention/test_hack_paged.py
echo "done; remove the venv with: rm -rf $VENV"
