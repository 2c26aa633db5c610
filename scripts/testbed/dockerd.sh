#!/usr/bin/env bash
# The test bed's own Docker daemon, used to build images (never to run the node's
# pods: the node has its own containerd, see node.sh).
#   dockerd.sh start   start it unless it answers already; prints DOCKER_HOST
#   dockerd.sh stop    stop it (the daemon of this data directory, if running)
#   dockerd.sh env     print DOCKER_HOST=... for the socket
# Its data and state live under $SLIMSPEC_CACHE/docker, so images and build layers
# survive between runs. It creates no network that routes anywhere: no bridge, no
# iptables rules, no masquerade; builds that download (pip, apt) use --network host.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

DOCKER_DIR="$SLIMSPEC_CACHE/docker"
DOCKER_SOCK="$DOCKER_DIR/docker.sock"
DOCKER_PID="$DOCKER_DIR/dockerd.pid"
export DOCKER_HOST="unix://$DOCKER_SOCK"
# Debian's client (20.10, the daemon's version): its classic builder needs no
# frontend image from a registry, and no client newer than the daemon is involved.
DOCKER_CLI=/usr/bin/docker

docker_answers() {
  [[ -S "$DOCKER_SOCK" ]] && timeout 10 "$DOCKER_CLI" version >/dev/null 2>&1
}

start() {
  mkdir -p "$DOCKER_DIR"
  exec 8>"$DOCKER_DIR/.start.lock"
  flock 8
  if docker_answers; then
    echo "DOCKER_HOST=$DOCKER_HOST"
    return 0
  fi
  command -v dockerd >/dev/null || {
    echo "dockerd missing: bash scripts/testbed/install.sh runtime" >&2
    return 1
  }
  # A daemon killed hard leaves its pid file and socket behind.
  rm -f "$DOCKER_SOCK" "$DOCKER_PID"
  setsid dockerd \
    --data-root "$DOCKER_DIR/data" \
    --exec-root "$DOCKER_DIR/run" \
    --pidfile "$DOCKER_PID" \
    --host "$DOCKER_HOST" \
    --bridge=none --iptables=false --ip6tables=false --ip-masq=false \
    --storage-driver=overlay2 \
    --log-level=warn \
    </dev/null >>"$DOCKER_DIR/dockerd.log" 2>&1 8>&- &
  local i
  for i in $(seq 1 300); do
    docker_answers && break
    if ! kill -0 $! 2>/dev/null; then
      tail -20 "$DOCKER_DIR/dockerd.log" >&2
      return 1
    fi
    sleep 0.2
  done
  docker_answers || { echo "dockerd did not answer on $DOCKER_SOCK" >&2; return 1; }
  echo "DOCKER_HOST=$DOCKER_HOST"
}

stop() {
  local pid
  [[ -f "$DOCKER_PID" ]] || return 0
  pid="$(cat "$DOCKER_PID")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    local i
    for i in $(seq 1 150); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$DOCKER_PID" "$DOCKER_SOCK"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env) echo "DOCKER_HOST=$DOCKER_HOST" ;;
  *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
