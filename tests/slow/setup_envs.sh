#!/usr/bin/env bash
# Build the import-check virtualenvs for the slow test tier (pytest -m slow).
#
# Two venvs, one per triton version (which release uses which: tests/slow/releases.py):
#   $DYNSPEC_IMPORT_ENVS/triton331  torch 2.13.0 CPU + triton 3.3.1 + pure-Python deps (0.4.6.post5)
#   $DYNSPEC_IMPORT_ENVS/triton39   torch 2.13.0 CPU + triton 3.9.0 + pure-Python deps (0.4.10.post2+)
# The locks (requirements-<name>.txt) were produced by pip freeze; transformers is pinned to a
# version that the releases of that venv import with (4.54.1 / 5.6.0).
# Default location: ~/.cache/dynspec-patch/import-envs (outside any checkout).
# SGLang itself is NOT installed: each test puts a patched scratch copy of a pinned
# release on PYTHONPATH. sgl_kernel, flashinfer and torchvision are never installed;
# tests/slow/stubs/gpu_stubs.py stands in for them.
#
# Usage: bash tests/slow/setup_envs.sh [triton331|triton39 ...]   (default: both)
# Idempotent: a venv whose lock and torch pin are unchanged is kept (marker file .built).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="${DYNSPEC_IMPORT_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/dynspec-patch/import-envs}"
python="${DYNSPEC_ENV_PYTHON:-python3.11}"
envs=("$@")
[[ ${#envs[@]} -eq 0 ]] && envs=(triton331 triton39)

mkdir -p "$root"
# torch must be the CPU 2.13.0 wheel on local disk: an unpinned resolve pulls a 5 GB CUDA build.
constraints="$root/constraints.txt"
printf 'torch==2.13.0\n' >"$constraints"

build_one() {
    local name="$1" lock="$here/requirements-$1.txt"
    local venv="$root/$name" marker="$root/$name/.built"
    [[ -f "$lock" ]] || { echo "no lock file $lock" >&2; return 2; }
    local want
    want="$(cat "$lock" "$constraints" | sha256sum | cut -d' ' -f1)"
    if [[ -f "$marker" ]] && [[ "$(head -n1 "$marker")" == "$want" ]]; then
        echo "$name: up to date ($venv)"
        return 0
    fi
    local start=$SECONDS
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --retries 5 torch==2.13.0
    # --no-deps: the lock lists the whole closure, so nothing can drag in a different torch.
    "$venv/bin/pip" install --quiet --retries 5 --no-deps -c "$constraints" -r "$lock"
    "$venv/bin/pip" check || true  # informational: sglang's own deps are deliberately absent
    "$venv/bin/python" -c 'import torch, triton; assert not torch.version.cuda, torch.version.cuda; print(torch.__version__, triton.__version__)'
    local took=$((SECONDS - start))
    printf '%s\nbuilt %s in %ss\n' "$want" "$(date -u +%FT%TZ)" "$took" >"$marker"
    echo "$name: built in ${took}s ($venv)"
}

for name in "${envs[@]}"; do
    build_one "$name"
done
