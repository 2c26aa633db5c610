#!/usr/bin/env bash
# Builds the test bed's images for real, cached by content:
#   debian    Debian minbase + python3 (debootstrap from apt's own mirror, docker import):
#             no registry is reachable, so no FROM image can be pulled
#   base      debian + the CA certificates this machine adds to its trust store
#             (/usr/local/share/ca-certificates, e.g. a TLS-inspecting egress proxy's),
#             with pip pointed at the system bundle, so builds download as the host does
#   engine    Dockerfile.engine   with BASE_IMAGE=base (pip and apt through --network host)
#   operator  Dockerfile.operator with BASE_IMAGE=base
#   pause     the node's sandbox image: scripts/testbed/pause.c, static, FROM scratch
#   prometheus  Prometheus with Kubernetes discovery (install.sh prometheus-sd), FROM
#             scratch, for the in-cluster Prometheus of the end-to-end tests
#   keda      KEDA's operator (/keda) and metrics API server (/keda-adapter), static
#             (install.sh keda), FROM scratch, for the KEDA-mode autoscaling test
# Each tag is a hash of what goes into the image (Dockerfile, .dockerignore, the files
# it copies, the base image's tag, itself a hash of its inputs), so a second run with
# the same inputs builds nothing. The engine's build stage is tagged too
# (slimspec/engine-build): it is the layer cache that spares a code change the
# several-GB download of the locked wheels. Older tags are removed afterwards (the
# newest KEEP_TAGS of each stay), with the layers nothing uses.
#
#   images.sh [build]   build what is missing (starts the test bed's dockerd, stops it
#                       again if it started it); prints the tags
#   images.sh build --without-prometheus   all but the Prometheus and KEDA images (whose
#                       binaries another Go build may still be making: scripts/test.sh
#                       overlaps them)
#   images.sh tags      print the tags the current checkout needs (builds nothing)
# Output lines: BASE_IMAGE= ENGINE_IMAGE= OPERATOR_IMAGE= PAUSE_IMAGE= PROMETHEUS_IMAGE=
#   KEDA_IMAGE=
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/versions.sh"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DOCKER=/usr/bin/docker
export DOCKER_HOST="unix://$SLIMSPEC_CACHE/docker/docker.sock"
# The classic builder: BuildKit would fetch a frontend image from a registry.
export DOCKER_BUILDKIT=0
KEEP_TAGS=2 # per image: the current one and the one before (another checkout's)

hash_of() { sha256sum | cut -c1-16; }

# Hash of every file under the given paths that the build context holds (the same
# exclusions as .dockerignore).
files_hash() {
  (cd "$REPO_ROOT" && find "$@" -type f \
    ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path '*.egg-info/*' \
    ! -path 'engine/build/*' ! -path 'operator/build/*' ! -path '*/.pytest_cache/*' \
    ! -name '*.safetensors' ! -name '*.gguf' ! -name '*.bin' -print0 |
    sort -z | xargs -0 sha256sum) | hash_of
}

LOCAL_CA_DIR=/usr/local/share/ca-certificates

debian_tag() {
  echo "slimspec/debian:$BASE_SUITE-$(printf '%s\n' "$BASE_SUITE" "$BASE_DEBS" | hash_of)"
}

base_tag() {
  local h
  h="$({
    debian_tag
    find "$LOCAL_CA_DIR" -name '*.crt' -type f -print0 2>/dev/null | sort -z | xargs -0r cat
  } | hash_of)"
  echo "slimspec/base:$BASE_SUITE-$h"
}

prometheus_tag() { echo "slimspec/prometheus:$PROMETHEUS_SD_VERSION"; }
PROMETHEUS_BIN="$SLIMSPEC_CACHE/prometheus/$PROMETHEUS_SD_MODULE_VERSION/prometheus"

keda_tag() { echo "slimspec/keda:${KEDA_VERSION#v}"; }
KEDA_DIR="$SLIMSPEC_CACHE/keda/$KEDA_VERSION"

pause_tag() {
  echo "slimspec/pause:$(cat "$HERE/pause.c" | hash_of)"
}

image_id() { "$DOCKER" image inspect --format '{{.Id}}' "$1" 2>/dev/null; }

# image_tag NAME DOCKERFILE BASE_TAG PATHS...: the content tag of an image.
image_tag() {
  local name="$1" dockerfile="$2" base="$3"
  shift 3
  local h
  h="$({
    echo "base=$base"
    (cd "$REPO_ROOT" && sha256sum "$dockerfile" .dockerignore)
    files_hash "$@"
  } | hash_of)"
  echo "slimspec/$name:$h"
}

# The Debian mirror apt uses here (deb822 .sources or a classic sources.list).
apt_mirror() {
  local url
  url="$(awk -v s="$BASE_SUITE" '
      /^URIs:/ {uri=$2}
      /^Suites:/ {for (i = 2; i <= NF; i++) if ($i == s) {print uri; exit}}
    ' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)"
  if [[ -z "$url" ]]; then
    url="$(awk -v s="$BASE_SUITE" '$1 == "deb" && $3 == s {print $2; exit}' \
      /etc/apt/sources.list 2>/dev/null || true)"
  fi
  [[ -n "$url" ]] || { echo "no Debian mirror for $BASE_SUITE in apt's sources" >&2; return 1; }
  echo "$url"
}

build_debian() {
  local tag="$1" root mirror
  if image_id "$tag" >/dev/null; then echo "cached: $tag"; return 0; fi
  mirror="$(apt_mirror)"
  root="$SLIMSPEC_CACHE/images/rootfs.tmp"
  rm -rf "$root" && mkdir -p "$root"
  nice -n 10 debootstrap --variant=minbase --include="$BASE_DEBS" "$BASE_SUITE" "$root" \
    "$mirror" >"$SLIMSPEC_CACHE/images/debootstrap.log" 2>&1 || {
    tail -20 "$SLIMSPEC_CACHE/images/debootstrap.log" >&2
    return 1
  }
  # Downloaded .debs and package lists only make the image bigger; builds that
  # need apt run `apt-get update` first.
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | "$DOCKER" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' - "$tag" >/dev/null
  rm -rf "$root"
  "$DOCKER" run --rm --network none "$tag" python3 -c 'import venv, ssl' # it runs
}

build_base() {
  local tag="$1" debian="$2" work
  if image_id "$tag" >/dev/null; then echo "cached: $tag"; return 0; fi
  work="$(mktemp -d)"
  mkdir "$work/local-ca"
  find "$LOCAL_CA_DIR" -name '*.crt' -type f -exec cp {} "$work/local-ca/" \; 2>/dev/null || true
  cat >"$work/Dockerfile" <<EOF
FROM $debian
COPY local-ca/ $LOCAL_CA_DIR/
RUN update-ca-certificates >/dev/null
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
EOF
  "$DOCKER" build --quiet --network none -t "$tag" "$work" >/dev/null
  rm -rf "$work"
}

build_pause() {
  local tag="$1" work
  if image_id "$tag" >/dev/null; then echo "cached: $tag"; return 0; fi
  work="$(mktemp -d)"
  gcc -static -O2 -s -o "$work/pause" "$HERE/pause.c"
  tar -C "$work" -c pause | "$DOCKER" import --change 'ENTRYPOINT ["/pause"]' - "$tag" >/dev/null
  rm -rf "$work"
}

build_prometheus() {
  local tag="$1" work
  if image_id "$tag" >/dev/null; then echo "cached: $tag"; return 0; fi
  [[ -x "$PROMETHEUS_BIN" ]] || {
    echo "$PROMETHEUS_BIN missing: bash scripts/testbed/install.sh prometheus-sd" >&2
    return 1
  }
  work="$(mktemp -d)"
  mkdir -p "$work/bin" "$work/prometheus"
  cp "$PROMETHEUS_BIN" "$work/bin/prometheus"
  tar -C "$work" --owner=65534 --group=65534 -c bin prometheus |
    "$DOCKER" import --change 'ENTRYPOINT ["/bin/prometheus"]' --change 'USER 65534:65534' \
      --change 'WORKDIR /prometheus' - "$tag" >/dev/null
  rm -rf "$work"
}

build_keda() {
  local tag="$1" work
  if image_id "$tag" >/dev/null; then echo "cached: $tag"; return 0; fi
  [[ -x "$KEDA_DIR/keda" && -x "$KEDA_DIR/keda-adapter" ]] || {
    echo "$KEDA_DIR missing: bash scripts/testbed/install.sh keda" >&2
    return 1
  }
  work="$(mktemp -d)"
  cp "$KEDA_DIR/keda" "$KEDA_DIR/keda-adapter" "$work/"
  # The uid KEDA's own images run as (distroless nonroot).
  tar -C "$work" --owner=65532 --group=65532 -c keda keda-adapter |
    "$DOCKER" import --change 'ENTRYPOINT ["/keda"]' --change 'USER 65532:65532' \
      - "$tag" >/dev/null
  rm -rf "$work"
}

# build_image TAG DOCKERFILE BASE_TAG: the build stage first, under its own tag
# (slimspec/NAME-build:HASH) so its layers stay as the cache, then the image.
build_image() {
  local tag="$1" dockerfile="$2" base="$3"
  if image_id "$tag" >/dev/null; then echo "cached: $tag"; return 0; fi
  local build_tag="${tag%%:*}-build:${tag#*:}" stage
  for stage in build runtime; do
    (cd "$REPO_ROOT" && nice -n 10 "$DOCKER" build --network host --quiet \
      --build-arg "BASE_IMAGE=$base" --target "$stage" -f "$dockerfile" \
      -t "$([[ $stage == build ]] && echo "$build_tag" || echo "$tag")" .) >/dev/null || return
  done
}

# Tags in the order this script last wanted them (an image's own creation time does
# not say: a build whose layers all come from the cache keeps the old one).
TAG_LOG="$SLIMSPEC_CACHE/images/wanted-tags.log"
note_wanted() { local t; for t in "$@"; do echo "$(date +%s) $t" >>"$TAG_LOG"; done; }

# prune_repo TAG: of TAG's repository keep TAG and the KEEP_TAGS-1 tags wanted last
# before it; remove the others.
prune_repo() {
  local current="$1" repo="${1%%:*}" keep old
  keep="$( (echo "$current"
    grep " $repo:" "$TAG_LOG" 2>/dev/null | sort -n | awk '{print $2}' | grep -vx "$current" |
      awk '!seen[$0]++' | tail -n $((KEEP_TAGS - 1))) | sort -u)"
  for old in $("$DOCKER" images --format '{{.Repository}}:{{.Tag}}' "$repo"); do
    grep -qx "$old" <<<"$keep" || "$DOCKER" rmi "$old" >/dev/null
  done
}

compute_tags() {
  DEBIAN_IMAGE="$(debian_tag)"
  BASE_IMAGE="$(base_tag)"
  PAUSE_IMAGE="$(pause_tag)"
  PROMETHEUS_IMAGE="$(prometheus_tag)"
  KEDA_IMAGE="$(keda_tag)"
  ENGINE_IMAGE="$(image_tag engine Dockerfile.engine "$BASE_IMAGE" engine scripts/image)"
  OPERATOR_IMAGE="$(image_tag operator Dockerfile.operator "$BASE_IMAGE" operator)"
}

print_tags() {
  printf 'BASE_IMAGE=%s\nENGINE_IMAGE=%s\nOPERATOR_IMAGE=%s\nPAUSE_IMAGE=%s\nPROMETHEUS_IMAGE=%s\nKEDA_IMAGE=%s\n' \
    "$BASE_IMAGE" "$ENGINE_IMAGE" "$OPERATOR_IMAGE" "$PAUSE_IMAGE" "$PROMETHEUS_IMAGE" \
    "$KEDA_IMAGE"
}

build_all() {
  local with_prometheus=1
  [[ "${1:-}" == --without-prometheus ]] && with_prometheus=0
  mkdir -p "$SLIMSPEC_CACHE/images"
  exec 7>"$SLIMSPEC_CACHE/images/.build.lock"
  flock 7
  local started=0
  if ! "$DOCKER" version >/dev/null 2>&1; then
    bash "$HERE/dockerd.sh" start >/dev/null
    started=1
  fi
  local rc=0
  {
    compute_tags &&
      step "debian image (debootstrap $BASE_SUITE minbase + $BASE_DEBS)" \
        build_debian "$DEBIAN_IMAGE" &&
      step "base image (+ this machine's CA certificates)" \
        build_base "$BASE_IMAGE" "$DEBIAN_IMAGE" &&
      step "pause image (static, FROM scratch)" build_pause "$PAUSE_IMAGE" &&
      step "operator image (Dockerfile.operator)" \
        build_image "$OPERATOR_IMAGE" Dockerfile.operator "$BASE_IMAGE" &&
      step "engine image (Dockerfile.engine)" \
        build_image "$ENGINE_IMAGE" Dockerfile.engine "$BASE_IMAGE" &&
      { ((with_prometheus == 0)) ||
        { step "prometheus image (FROM scratch)" build_prometheus "$PROMETHEUS_IMAGE" &&
          step "keda image (FROM scratch)" build_keda "$KEDA_IMAGE"; }; } &&
      step "prune old image tags and unused layers" prune_all
  } || rc=$?
  ((rc == 0)) && "$DOCKER" images --format '{{.Repository}}:{{.Tag}}  {{.Size}}' 'slimspec/*'
  ((started)) && bash "$HERE/dockerd.sh" stop
  ((rc == 0)) && print_tags
  return "$rc"
}

prune_all() {
  local tag wanted=("$DEBIAN_IMAGE" "$BASE_IMAGE" "$PAUSE_IMAGE" "$PROMETHEUS_IMAGE" "$KEDA_IMAGE"
    "$ENGINE_IMAGE" "${ENGINE_IMAGE/engine:/engine-build:}"
    "$OPERATOR_IMAGE" "${OPERATOR_IMAGE/operator:/operator-build:}")
  note_wanted "${wanted[@]}"
  for tag in "${wanted[@]}"; do prune_repo "$tag"; done
  "$DOCKER" image prune --force >/dev/null
  "$DOCKER" container prune --force >/dev/null
}

case "${1:-build}" in
  build) build_all "${2:-}" ;;
  tags) compute_tags && print_tags ;;
  *) echo "usage: $0 [build|tags]" >&2; exit 2 ;;
esac
