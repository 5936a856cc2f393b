#!/usr/bin/env bash
# Run every test tier of dynspec-patch from a clean checkout (the README's test command).
#     bash tests/run.sh [PYTEST_ARGS...]     (test paths relative to the checkout: tests/...)
#
# Does its own set-up. Run as root on Debian or Ubuntu (the SSH tier starts its own sshd on
# 127.0.0.1 and creates test accounts; the container tier starts its own dockerd), it first
# installs the system packages the tiers need (tests/setup_machine.sh); otherwise it says in
# one line what is missing and stops. Needs Python >= 3.11.
#
# What the tests run is what users install (issue 13): the wheel built from this checkout,
# installed NOT editable into ./.venv, run from a scratch directory outside the checkout
# (tests/installed.sh; tests/conftest.py stops a session run any other way, and
# tests/pytest.sh runs a part of the suite the same way).
# Fetches every pinned SGLang wheel into the cache (sha256-checked) while proving each codemod
# on it (check-pins), builds the slow tier's import virtualenvs, then runs pytest offline: the
# tests themselves talk only to 127.0.0.0/8. The fleet tests run the real ansible-playbook and
# sglang-router (both from the test extras) and OpenSSH's ssh client (ssh -G).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

bash tests/setup_machine.sh
source tests/installed.sh  # build_wheel, install_wheel, run_pytest; $scratch

venv=$(realpath -m "${DYNSPEC_VENV:-.venv}")
pip_opts=(--quiet --retries 5 --disable-pip-version-check)
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
# torch only for the runtime's CPU tests: exactly the CPU build 2.13.0+cpu, whatever pip's local
# configuration says (PIP_CONFIG_FILE=/dev/null and --isolated ignore every config file and PIP_*
# variable). It comes from $DYNSPEC_TORCH_WHEELS (default /opt/wheels, where this machine kind
# keeps it); without that file pip stops here instead of downloading a CUDA build of several GB.
PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" --isolated install "${pip_opts[@]}" --no-deps \
    --no-index --find-links "${DYNSPEC_TORCH_WHEELS:-/opt/wheels}" "torch==2.13.0+cpu"
"$venv/bin/pip" install "${pip_opts[@]}" "setuptools>=77"  # builds the wheel, offline
wheel=$(build_wheel "$venv")
install_wheel "$venv" "$wheel" "[test]" "torch==2.13.0+cpu"  # + torch's own deps

echo "== lint"
"$venv/bin/ruff" check .

echo "== module names the installed package spells as strings resolve there"
# isolated (-I) and from outside the checkout: a name resolves only where an installed user's does
(cd "$scratch" && "$venv/bin/python" -I "$repo/tests/packaging/module_names.py")

echo "== ansible-test sanity on the collection"
bash tests/ansible_sanity.sh "$venv"

echo "== check-pins: apply, re-apply, revert on every pinned release"
(cd "$scratch" && "$venv/bin/dynspec-patch" check-pins)

echo "== declared minimum versions: the CLI tests on exactly the lower bounds in pyproject.toml"
min_venv=$(realpath -m "${DYNSPEC_MIN_VENV:-.venv-min}")
[[ -x "$min_venv/bin/python" ]] || python3 -m venv "$min_venv"
"$venv/bin/python" -c '
import tomllib
for dependency in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    print(dependency.replace(">=", "=="))
' > "$min_venv/constraints.txt"
install_wheel "$min_venv" "$wheel" "" -c "$min_venv/constraints.txt" "pytest>=8"
"$min_venv/bin/pip" check
DYNSPEC_OFFLINE=1 run_pytest "$min_venv" -q \
    tests/codemods/test_cli_contract.py tests/codemods/test_native_and_cli.py

echo "== slow tier virtualenvs"
bash tests/slow/setup_envs.sh

echo "== tests"
export DYNSPEC_OFFLINE=1
run_pytest "$venv" -m "not slow" -q "$@"
run_pytest "$venv" -m slow -q "$@"
