#!/usr/bin/env bash
# The machine set-up of tests/run.sh (its first step): the system packages the test tiers need.
# As root on Debian or Ubuntu, the missing ones are installed with apt-get; otherwise one line
# says what is missing (or that root is needed) and the suite does not start (exit 1).
#
#   openssh-server, openssh-client  the SSH tier's own sshd; ssh -G for the fleet tests
#   sudo                            the test accounts' passwordless sudo
#   util-linux                      unshare / nsenter: the SSH tier's PID namespace
#   python3-venv                    Debian's python3 -m venv (./.venv, the hosts' virtualenvs)
#   docker.io                       dockerd, containerd, runc, /usr/bin/docker: container tests
#   pipx                            the README's first command (.ci/run runs it after the suite)
set -euo pipefail

packages=(openssh-server openssh-client sudo util-linux python3-venv docker.io pipx)

if ! command -v dpkg-query >/dev/null; then
    echo "tests/run.sh: no dpkg-query (not Debian/Ubuntu): the tiers need ${packages[*]}" \
        "or their equivalents installed; going on" >&2
    exit 0
fi
missing=()
for package in "${packages[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Abbrev}' "$package" 2>/dev/null || true)
    [[ $status == ii* ]] || missing+=("$package")
done

if [[ $(id -u) -ne 0 ]]; then
    if ((${#missing[@]})); then
        echo "tests/run.sh: missing system packages: ${missing[*]} (run as root it installs" \
            "them: sudo bash tests/run.sh)" >&2
    else
        echo "tests/run.sh: needs root: the SSH and container tiers start their own sshd and" \
            "dockerd and create test accounts (sudo bash tests/run.sh)" >&2
    fi
    exit 1
fi
((${#missing[@]})) || exit 0

echo "== system packages: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Packages must not start their services (docker.io would start a default dockerd with a
# bridge and NAT rules): the tests start their own sshd and dockerd, and stop them.
policy=/usr/sbin/policy-rc.d
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    trap 'rm -f "$policy"' EXIT
fi
apt-get update -o Acquire::Retries=3 -qq
apt-get install -y -qq --no-install-recommends -o Acquire::Retries=3 "${missing[@]}" >/dev/null
