#!/usr/bin/env bash
# Build an offline bundle of CUDA vLLM for a GPU machine that has no package index but has
# torch (how bench/results/gpu_llama1b* were made; see docs/PERFORMANCE.md, "GPU machines").
#
# It downloads vLLM's CUDA wheel and scripts/gpu-offline-requirements.txt for the GPU box's
# Python, adds engine-gateway itself, unpacks them into one folder and drops what a Hopper run
# does not load: the FlashAttention-2 kernels (vLLM uses FA3 on Hopper) and DeepGEMM. The
# result is one .tar.xz (~160 MB) split into parts small enough to carry, plus its sha256.
# vLLM's C extensions are built against torch's stable ABI; every torch symbol they use
# resolves in torch 2.11 (checked with `nm -D`), so the box's own torch serves.
#
# Usage: scripts/gpu_offline_bundle.sh OUT_DIR [PYTHON_VERSION (3.12)] [PART_SIZE (52M)]
# Then on the GPU box: scripts/gpu_offline_run.sh OUT_DIR python3 -m bench ...
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "$1"); pyver=${2:-3.12}; part=${3:-52M}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$out" "$work/wheels" "$work/site"

platforms=()
for n in 5 12 17 24 27 28 31 34 35 38 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
grep -v -e '^#' -e '^$' scripts/gpu-offline-requirements.txt | while read -r spec; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
        --implementation cp "${platforms[@]}" -d "$work/wheels" "$spec"
done
python3 -m pip wheel -q --no-deps -w "$work/wheels" .

for wheel in "$work/wheels"/*.whl; do unzip -q -o "$wheel" -d "$work/site"; done
rm -f "$work/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
rm -rf "$work/site/vllm/third_party/deep_gemm"
tar -C "$work/site" -cf - . | xz -T0 -6 > "$work/site.tar.xz"
rm -f "$out"/site.tar.xz.part*
split -b "$part" -d -a 2 "$work/site.tar.xz" "$out/site.tar.xz.part"
sha256sum < "$work/site.tar.xz" | cut -c1-64 > "$out/site.tar.xz.sha256"
ls -l "$out"
