#!/usr/bin/env bash
# pytest on a part of the suite, run the way tests/run.sh runs it (the only way tests/conftest.py
# accepts): on the wheel built from this checkout, installed (not editable) into $DYNSPEC_VENV
# (default ./.venv, which tests/run.sh makes), from a scratch directory outside the checkout.
# Arguments go to pytest; test paths are relative to the checkout:
#     bash tests/pytest.sh tests/codemods -k plan_cache -q
# Tiers that start sshd, dockerd, ansible or sglang-router, and the slow tier, need what
# tests/run.sh sets up first (system packages, pinned wheels, slow-tier virtualenvs).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$repo/tests/installed.sh"

venv=$(cd "$repo" && realpath -m "${DYNSPEC_VENV:-.venv}")
if [[ ! -x $venv/bin/python ]]; then
    echo "tests/pytest.sh: no virtualenv at $venv: run bash tests/run.sh once (it makes it)" >&2
    exit 2
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps --force-reinstall \
    "$(build_wheel "$venv")"
run_pytest "$venv" "$@"
