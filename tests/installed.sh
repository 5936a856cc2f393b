# Sourced by tests/run.sh and tests/pytest.sh (not run on its own): the tests run what users
# install (issue 13). Build this checkout's wheel, install it NOT editable into a virtualenv,
# and run pytest on it from a scratch directory outside the checkout, with no checkout path on
# sys.path or PYTHONPATH. tests/conftest.py stops any session that is run another way.
#
# The caller sets $repo (the checkout, absolute). Sourcing defines $scratch, a directory outside
# the checkout that is removed when the calling script exits.

scratch=$(mktemp -d "${TMPDIR:-/tmp}/dynspec-tests-XXXXXX")
trap 'rm -rf "$scratch"' EXIT

# build_wheel VENV: build the wheel with VENV's pip (setuptools>=77 installed there; offline, no
# build isolation) and print its path. It is built from a copy of the files git knows (tracked,
# or new and not ignored), so a stale build/ or *.egg-info in the checkout cannot leak into it.
build_wheel() {
    local venv=$1 source="$scratch/wheel-source" out="$scratch/wheel"
    rm -rf "$source" "$out"
    mkdir -p "$source" "$out"
    git -C "$repo" ls-files -z -co --exclude-standard \
        | tar -C "$repo" --null --files-from=- --ignore-failed-read -cf - 2>/dev/null \
        | tar -C "$source" -xf -
    "$venv/bin/pip" wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
        --wheel-dir "$out" "$source" >&2
    local wheels=("$out"/dynspec_patch-*.whl)
    printf '%s\n' "${wheels[0]}"
}

# install_wheel VENV WHEEL EXTRAS [PIP_ARGS...]: install WHEEL (with EXTRAS, e.g. "[test]" or "")
# and its dependencies, then WHEEL itself again by force: its version does not change from one
# commit to the next, so a plain install would keep the files of an earlier build (or an
# editable install of the checkout) in place.
install_wheel() {
    local venv=$1 wheel=$2 extras=$3
    shift 3
    local pip_opts=(--quiet --retries 5 --disable-pip-version-check)
    "$venv/bin/pip" install "${pip_opts[@]}" "$wheel$extras" "$@"
    "$venv/bin/pip" install "${pip_opts[@]}" --no-deps --force-reinstall "$wheel"
}

# run_pytest VENV [PYTEST_ARGS...]: pytest of VENV, run in $scratch with the checkout's
# configuration. Arguments that start with tests/ are paths relative to the checkout; without any
# path the whole tests/ directory is collected (testpaths only applies when pytest runs in the
# rootdir, which it does not here).
run_pytest() {
    local venv=$1 arg paths=0
    shift
    local args=()
    for arg in "$@"; do
        if [[ $arg == tests || $arg == tests/* ]]; then
            args+=("$repo/$arg")
            paths=1
        else
            [[ $arg == /* && -e ${arg%%::*} ]] && paths=1
            args+=("$arg")
        fi
    done
    ((paths)) || args+=("$repo/tests")
    (cd "$scratch" && "$venv/bin/python" -m pytest -c "$repo/pyproject.toml" --rootdir "$repo" \
        -p no:cacheprovider "${args[@]}")
}
