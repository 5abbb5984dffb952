#!/usr/bin/env bash
# The Debian packages that ragblend's checks need, installed only when a command is missing:
# `system-deps.sh test` (make test, .ci/run) and `system-deps.sh deploy` (make test-deploy).
set -euo pipefail

# command:package (or /path:package for what is not a command). test: promtool and a
# Prometheus server of the tests' own on 127.0.0.1 (tests/deploy), and a redis-server the
# remote-tier tests start on 127.0.0.1 (tests/redis_server.py). deploy: the image build and the
# compose stack with podman.
case "${1:-test}" in
    test) wanted=(promtool:prometheus prometheus:prometheus redis-server:redis-server) ;;
    # catatonit: the init process of `init: true` services; dnsname: the CNI plugin that lets
    # the services find each other by name (both only recommended by podman).
    deploy) wanted=(podman:podman runc:runc podman-compose:podman-compose debootstrap:debootstrap
                    catatonit:catatonit
                    /usr/lib/cni/dnsname:golang-github-containernetworking-plugin-dnsname) ;;
    *) echo "usage: $0 [test|deploy]" >&2; exit 2 ;;
esac

packages=()
for pair in "${wanted[@]}"; do
    need=${pair%%:*}
    if [[ $need == /* ]]; then
        [ -e "$need" ] || packages+=("${pair#*:}")
    else
        command -v "$need" >/dev/null || packages+=("${pair#*:}")
    fi
done
[ ${#packages[@]} -gt 0 ] || exit 0
mapfile -t packages < <(printf '%s\n' "${packages[@]}" | sort -u)

fail() {
    echo "system-deps: $1; install the package(s) ${packages[*]} yourself" \
        "(Debian/Ubuntu: sudo apt-get install ${packages[*]}) and rerun" >&2
    exit 1
}
command -v apt-get >/dev/null || fail "no apt-get here"
sudo_=()
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || fail "not root and no sudo"
    sudo_=(sudo)
fi

echo "system-deps: installing ${packages[*]} with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
"${sudo_[@]}" apt-get update -qq || fail "apt-get update failed"
# policy-rc.d exit 101: a package must not start its own service (Prometheus on port 9090,
# Redis on 6379).
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | "${sudo_[@]}" tee "$policy" >/dev/null
    "${sudo_[@]}" chmod +x "$policy"
    own_policy=1
fi
status=0
"${sudo_[@]}" apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null || status=$?
[ "$own_policy" -eq 0 ] || "${sudo_[@]}" rm -f "$policy"
[ "$status" -eq 0 ] || fail "apt-get install failed"
