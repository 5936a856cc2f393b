#!/usr/bin/env bash
# Run every test tier of dynspec-patch from a clean checkout (the README's test command).
#
# Needs Python >= 3.11, and for the SSH tier openssh-server + sudo installed and root
# (the tests start their own sshd on 127.0.0.1 and create their own test accounts).
# The fleet tests run the real ansible-playbook and sglang-router (both from the test extras)
# and OpenSSH's ssh client (ssh -G).
# Creates ./.venv, fetches every pinned SGLang wheel into the cache (sha256-checked) while
# proving each codemod on it (check-pins), builds the slow tier's import virtualenvs, then
# runs pytest offline: the tests themselves talk only to 127.0.0.0/8.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="${DYNSPEC_VENV:-.venv}"
pip_opts=(--quiet --retries 5 --disable-pip-version-check)
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
# torch only for the runtime's CPU tests: exactly the CPU build 2.13.0+cpu, whatever pip's local
# configuration says (PIP_CONFIG_FILE=/dev/null and --isolated ignore every config file and PIP_*
# variable). It comes from $DYNSPEC_TORCH_WHEELS (default /opt/wheels, where this machine kind
# keeps it); without that file pip stops here instead of downloading a CUDA build of several GB.
PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" --isolated install "${pip_opts[@]}" --no-deps \
    --no-index --find-links "${DYNSPEC_TORCH_WHEELS:-/opt/wheels}" "torch==2.13.0+cpu"
"$venv/bin/pip" install "${pip_opts[@]}" -e '.[test]' "torch==2.13.0+cpu"  # + torch's own deps

echo "== lint"
"$venv/bin/ruff" check .

echo "== check-pins: apply, re-apply, revert on every pinned release"
"$venv/bin/dynspec-patch" check-pins

echo "== declared minimum versions: the CLI tests on exactly the lower bounds in pyproject.toml"
min_venv="${DYNSPEC_MIN_VENV:-.venv-min}"
[[ -x "$min_venv/bin/python" ]] || python3 -m venv "$min_venv"
"$venv/bin/python" -c '
import tomllib
for dependency in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    print(dependency.replace(">=", "=="))
' > "$min_venv/constraints.txt"
"$min_venv/bin/pip" install "${pip_opts[@]}" -c "$min_venv/constraints.txt" -e . "pytest>=8"
"$min_venv/bin/pip" check
DYNSPEC_OFFLINE=1 "$min_venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/codemods/test_cli_contract.py tests/codemods/test_native_and_cli.py

echo "== slow tier virtualenvs"
bash tests/slow/setup_envs.sh

echo "== tests"
export DYNSPEC_OFFLINE=1
"$venv/bin/python" -m pytest -m "not slow" -q -p no:cacheprovider "$@"
"$venv/bin/python" -m pytest -m slow -q -p no:cacheprovider "$@"
