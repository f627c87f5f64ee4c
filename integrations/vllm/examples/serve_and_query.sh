#!/usr/bin/env bash
# End to end on a GPU machine: ragkv ingests passages (chunk KV stored), vLLM serves the same model with
# the ragkv plugin and connector, and the questions are asked twice: full prefill vs blended stored KV.
#
# Needs: an NVIDIA GPU, vLLM 0.32.x and ragkv installed in the current environment, e.g.
#   pip install "vllm==0.32.*" && pip install -e ".[vllm,rag]"   (from the repo root)
# The plugin must be installed as the vllm.general_plugins entry point "ragkv" (pyproject.toml);
# check with: python -c "from importlib.metadata import entry_points as e; print(e(group='vllm.general_plugins'))"
#
# Environment (defaults in brackets):
#   MODEL   [Qwen/Qwen2.5-1.5B-Instruct]  a Llama / Mistral / Qwen2 safetensors checkpoint (folder or hub id)
#   DTYPE   [bfloat16]   must be the same for ingest and serving (it is part of the KV fingerprint)
#   WORK    [/tmp/ragkv-vllm]   index, KV store and server log go here
#   N       [20]         questions of the dataset (their 10 passages each are ingested)
#   RATIO   [0.15]       HKVD recompute ratio
#   PORT    [8000]       vLLM server port
#   EAGER   [0]          1 adds --enforce-eager (no CUDA graphs; for debugging)
#   HACK    [0]          1 serves with ragkv's HACK attention backend (--attention-backend CUSTOM): KV stored
#                        as 2-bit HACK pages, decode by homomorphic attention (Triton). Uses --block-size 64
#                        (the paper's Pi; the kernel needs >= 32) and, on vLLM 0.33, --kv-cache-dtype hack_${HACK_BITS}bit
#   HACK_BITS [2]        2, 4 or 8 (on 0.32 passed as RAGKV_HACK_BITS, with --kv-cache-dtype auto)
#   DATASET [<repo>/data/musique_s.json]
# Output: per-question answers, a table, and one JSON line (F1 and median server seconds, full vs blend);
# the connector's per-request log lines ("ragkv: request ... rows blended") are counted from the server log.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
DTYPE=${DTYPE:-bfloat16}
WORK=${WORK:-/tmp/ragkv-vllm}
N=${N:-20}
RATIO=${RATIO:-0.15}
PORT=${PORT:-8000}
DATASET=${DATASET:-$REPO/data/musique_s.json}
STORE="file://$WORK/kv"
LOG="$WORK/vllm-serve.log"
mkdir -p "$WORK"
cd "$REPO"

python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script needs a GPU')"
python -c "import vllm; v = vllm.__version__; assert v.startswith(('0.32', '0.33')), f'vLLM {v}: the plugin is contract-tested against 0.32 and 0.33 only'"

echo "== 1. ingest with ragkv ($MODEL, $DTYPE, cuda) into $STORE"
python "$HERE/rag_vllm.py" ingest --model "$MODEL" --dtype "$DTYPE" --device cuda \
  --data-dir "$WORK/rag" --store "$STORE" --dataset "$DATASET" -n "$N"

echo "== 2. start vllm serve with the ragkv connector (log: $LOG)"
EXTRA=()
[ "${EAGER:-0}" = "1" ] && EXTRA+=(--enforce-eager)
if [ "${HACK:-0}" = "1" ]; then
  HACK_BITS=${HACK_BITS:-2}
  export RAGKV_HACK_BITS=$HACK_BITS
  if python -c "import vllm, sys; sys.exit(0 if vllm.__version__.startswith('0.32') else 1)"; then
    KV_DTYPE=auto  # 0.32: no custom dtypes; the backend still allocates HACK-sized pages (customize_spec)
  else
    KV_DTYPE="hack_${HACK_BITS}bit"  # 0.33: registered by the plugin (register_kv_cache_dtype)
  fi
  EXTRA+=(--attention-backend CUSTOM --kv-cache-dtype "$KV_DTYPE" --block-size 64)
  echo "   HACK backend: ${HACK_BITS}-bit pages, --kv-cache-dtype $KV_DTYPE"
fi
KV_CONFIG=$(printf '{"kv_connector":"RagkvConnector","kv_role":"kv_both","kv_connector_module_path":"ragkv_vllm.connector","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"store":"%s"}}' "$STORE")
# headroom for the blend's working memory (it runs outside vLLM's memory accounting)
# --no-enable-prefix-caching: vLLM would otherwise cache the blended blocks by token hash and serve them to the
# "full" request of the same prompt (and the full blocks to the "blend" one), mixing up the comparison.
vllm serve "$MODEL" --dtype "$DTYPE" --port "$PORT" --gpu-memory-utilization 0.8 --no-enable-prefix-caching \
  --kv-transfer-config "$KV_CONFIG" "${EXTRA[@]}" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  if curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null; then break; fi
  if ! kill -0 $SERVER 2>/dev/null; then echo "vllm serve exited; last log lines:"; tail -50 "$LOG"; exit 1; fi
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null || { echo "server not up after 600 s"; tail -50 "$LOG"; exit 1; }
grep -q "ragkv vLLM plugin registered" "$LOG" || echo "WARNING: the ragkv plugin did not log its registration (entry point installed?)"
if [ "${HACK:-0}" = "1" ]; then
  grep -E "GPU KV cache size|Maximum concurrency" "$LOG" | tail -2 || true  # compare with a HACK=0 run
fi

echo "== 3. ask $N questions: full prefill vs blend (ratio $RATIO)"
python "$HERE/rag_vllm.py" query --model "$MODEL" --dtype "$DTYPE" \
  --data-dir "$WORK/rag" --store "$STORE" --dataset "$DATASET" -n "$N" --ratio "$RATIO" \
  --url "http://127.0.0.1:$PORT"

echo "== connector log lines: $(grep -c 'ragkv: request' "$LOG" || true) blended requests;" \
     "$(grep -c 'ragkv:.*recomput' "$LOG" || true) recompute notices; errors:"
grep -E "ragkv:.*(error|cannot|failed)" "$LOG" | tail -5 || true
