#!/usr/bin/env bash
# The client library on the oldest and newest Python that vLLM supports (3.10-3.13) and
# this machine has (pyenv's versions, or python3.X on PATH): each in a venv with pyzmq and
# msgspec only, against a fake-engine gateway run by the project's .venv. Part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

found=()
for minor in 10 11 12 13; do
    candidate=""
    for path in "$HOME"/.pyenv/versions/3.$minor.*/bin/python3.$minor; do
        [[ -x "$path" ]] && candidate="$path"
    done
    if [[ -z "$candidate" ]] && command -v "python3.$minor" >/dev/null 2>&1 \
        && "python3.$minor" -c "" >/dev/null 2>&1; then
        candidate=$(command -v "python3.$minor")
    fi
    [[ -n "$candidate" ]] && found+=("$candidate")
done
if [[ ${#found[@]} -eq 0 ]]; then
    echo "client_pythons: no Python 3.10-3.13 found besides the project's; skipped" >&2
    exit 0
fi
pythons=("${found[0]}")
[[ ${#found[@]} -gt 1 ]] && pythons+=("${found[-1]}")

folder=$(mktemp -d /tmp/eg-compat-XXXXXX)
address="ipc://$folder/gw.sock"
"$PY" -m bench.fake_server --bind "$address" --max-model-len 4096 --step-interval 0.001 &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true; rm -rf "$folder"' EXIT
sleep 2
for python in "${pythons[@]}"; do
    version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    venv=".venv-client-$version"
    if [[ ! -x "$venv/bin/python" ]]; then
        "$python" -m venv "$venv"
        "$venv/bin/python" -m pip --disable-pip-version-check -q install "pyzmq>=25" "msgspec>=0.18"
    fi
    PYTHONPATH=. timeout 120 "$venv/bin/python" -m tests.client_compat "$address"
done
