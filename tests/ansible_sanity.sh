#!/usr/bin/env bash
# ansible-test sanity on the collection: the check every collection on Galaxy is held to.
#     bash tests/ansible_sanity.sh [VENV]        (default $DYNSPEC_VENV or ./.venv)
# Uses VENV's ansible-test (ansible-core from the test extras) on a copy of the collection in
# a scratch ansible_collections/dynspec/patch (the layout ansible-test requires; the copy keeps
# its tests/output out of the checkout). Each sanity test gets a virtualenv of its own,
# bootstrapped with a get-pip script ansible-test downloads from a host outside PyPI; where that
# script is not cached yet, a stand-in that runs the interpreter's own ensurepip is cached in its
# place. The tests' own requirements come from PyPI (cached with the virtualenvs in
# ~/.ansible/test).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(cd "$repo" && realpath -m "${1:-${DYNSPEC_VENV:-.venv}}")

# ansible-core 2.19.14 (the test extras' pin) asks for pip 24.2's bootstrap script.
get_pip="$HOME/.ansible/test/cache/get_pip_24_2.py"
if [[ ! -e $get_pip ]]; then
    mkdir -p "$(dirname "$get_pip")"
    printf '%s\n' '"""Stand-in for get-pip.py (its host is not reachable here): pip from ensurepip."""' \
        'import ensurepip' 'ensurepip.bootstrap()' > "$get_pip"
fi

scratch=$(mktemp -d "${TMPDIR:-/tmp}/dynspec-sanity-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
collection="$scratch/ansible_collections/dynspec/patch"
mkdir -p "$collection"
cp -a "$repo/ansible_collections/dynspec/patch/." "$collection/"
find "$collection" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$collection/tests/output"

python_version=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
log="$scratch/sanity.log"
if (cd "$collection" && "$venv/bin/ansible-test" sanity --python "$python_version" --local \
        --color no) >"$log" 2>&1; then
    echo "ansible-test sanity: $(grep -c '^Running sanity test' "$log") tests passed"
else
    grep -v -e '^Collecting ' -e '^  Downloading ' -e '^     ' -e '^Processing ' "$log" >&2
    exit 1
fi
