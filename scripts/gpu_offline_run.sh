#!/usr/bin/env bash
# On a GPU machine without a package index: unpack the bundle that
# scripts/gpu_offline_bundle.sh made (once, into $SITE) and run a command with it on the path,
# beside the machine's own torch. Example (the GPU figures of docs/PERFORMANCE.md):
#   scripts/gpu_offline_run.sh BUNDLE python3 -m bench.random_model llama-3.2-1b /root/llama1b
#   scripts/gpu_offline_run.sh BUNDLE python3 -m bench --model /root/llama1b --cuda-graphs \
#       --no-ceiling --targets gateway-ipc,gateway-tcp,vllm-http,direct --concurrency 1,64,256,1024 \
#       --prompt-len 128 --output-len 256 --name gpu_llama1b
set -euo pipefail
bundle=$(realpath "$1"); shift
SITE=${SITE:-/tmp/engine-gateway-site}
if [[ ! -d "$SITE/vllm" ]]; then
    want=$(cat "$bundle/site.tar.xz.sha256")
    got=$(cat "$bundle"/site.tar.xz.part* | sha256sum | cut -c1-64)
    [[ "$got" == "$want" ]] || { echo "bundle parts do not match its sha256" >&2; exit 1; }
    mkdir -p "$SITE.tmp" && cat "$bundle"/site.tar.xz.part* | xz -d -T0 | tar -x -C "$SITE.tmp"
    mv "$SITE.tmp" "$SITE"
fi
cd "$(dirname "$0")/.."
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# No network: no hub lookups, no usage stats. FlashInfer is not in the bundle, and vLLM's
# sampler imports it unless its sampler is turned off.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
exec "$@"
