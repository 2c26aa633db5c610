#!/usr/bin/env bash
# A real Kubernetes node for the test bed: containerd + runc + CNI (bridge,
# host-local, loopback, portmap) + kubelet + kube-proxy, all inside one private
# network + mount namespace that has only `lo`, the pods' bridge and (with a second
# node) a link to the other node: nothing is routed or masqueraded off the machine.
# The control plane (started by the Python test bed, slimspec_testbed.node.node_cluster)
# runs in the first node's network namespace, and the tests enter it to reach pod and
# Service addresses.
#
#   node.sh up DIR OWNER_PID [INDEX]  namespaces, bridge, cgroups, containerd, images;
#                              INDEX 0 (default) or 1: node slimspec-node (10.244.0.1,
#                              pods 10.244.0.0/24) or slimspec-node-2 (10.244.1.1,
#                              pods 10.244.1.0/24)
#   node.sh link DIR0 DIR1     a veth pair between two nodes' namespaces (10.243.0.1
#                              and .2) and a route to each other's pod range
#   node.sh start DIR          kubelet + kube-proxy (needs DIR/kubelet.kubeconfig and
#                              DIR/kube-proxy.kubeconfig from the control plane)
#   node.sh down DIR           stop and remove everything of that run
#   node.sh exec DIR CMD...    run CMD inside the node's network + mount namespace
#   node.sh import             import the images into the nodes' image stores now (a
#                              set-up step: `up` then finds them there)
#   node.sh cleanup            tear down runs whose owner died (also done by `up`)
#
# One node per image store runs at a time (its containerd keeps the imported images
# under $SLIMSPEC_NODE_STORE/containerd (node 0) and .../containerd-1 (node 1), default
# $SLIMSPEC_CACHE/node, a store only one daemon may open); `up` waits for the store's
# lock. `import` fills store 0 from Docker and makes store 1 a hard-linked clone of it
# (the layers' files are never written in place, so the second store costs seconds and
# no disk). SLIMSPEC_NODE_IMAGES picks the images to import (default: pause engine
# operator prometheus keda). A watchdog tears the node down when OWNER_PID exits, so a
# killed test run leaves nothing behind; `cleanup` (and every `up`) catches what a
# killed watchdog left.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/versions.sh"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The whole cluster's pod range (kube-proxy's clusterCIDR); each node has a /24 of it.
POD_CIDR=10.244.0.0/16
SERVICE_CIDR=10.0.0.0/24
LINK_NET=10.243.0
BRIDGE=cni0
RUN_PREFIX=slimspec-node-
NODE_CACHE="${SLIMSPEC_NODE_STORE:-$SLIMSPEC_CACHE/node}"
NODE_IMAGES="${SLIMSPEC_NODE_IMAGES:-pause engine operator prometheus keda}"
K8S_NODE_DIR="$SLIMSPEC_CACHE/k8s/$K8S_VERSION-node"
CNI_BIN=/usr/lib/cni
export PATH="$PATH:/usr/sbin:/sbin"

log() { echo "node: $*" >&2; }

node_vars() { # node_vars INDEX: the name, addresses, image store and lock of node INDEX
  NODE_INDEX="${1:-0}"
  [[ "$NODE_INDEX" =~ ^[01]$ ]] || { log "node index $NODE_INDEX: 0 or 1"; exit 2; }
  local suffix=""
  NODE_NAME=slimspec-node
  if ((NODE_INDEX > 0)); then
    suffix="-$NODE_INDEX"
    NODE_NAME="slimspec-node-$((NODE_INDEX + 1))"
  fi
  NODE_IP="10.244.$NODE_INDEX.1"
  NODE_SUBNET="10.244.$NODE_INDEX.0/24"
  CONTAINERD_ROOT="$NODE_CACHE/containerd$suffix"
  NODE_LOCK="$NODE_CACHE/.lock$suffix"
}
node_vars 0

state() { # state DIR KEY
  sed -n "s/^$2=//p" "$1/state.env" 2>/dev/null
}

in_ns() { # in_ns DIR CMD...: run CMD in the node's network + mount namespace
  local dir="$1" holder
  shift
  holder="$(state "$dir" HOLDER_PID)"
  nsenter -t "$holder" -n -m -- "$@"
}

ctr_() { # ctr_ DIR ARGS...: ctr against the run's containerd (in the namespace, if any)
  local dir="$1"
  shift
  if [[ -n "$(state "$dir" HOLDER_PID)" ]]; then
    in_ns "$dir" ctr -a "$dir/containerd.sock" -n k8s.io "$@"
  else
    ctr -a "$dir/containerd.sock" -n k8s.io "$@"
  fi
}

alive() { # a running process (a zombie, dead but not yet reaped, is not)
  local st
  [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null || return 1
  # Empty: the process was reaped between the two reads, so it is gone too.
  st="$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)"
  [[ -n "$st" && "$st" != Z ]]
}

holder_ready() { # unshare has made the new namespaces (and exec'd sleep)
  [[ "$(stat -Lc %i "/proc/$1/ns/net")" != "$(stat -Lc %i /proc/self/ns/net)" &&
    "$(stat -Lc %i "/proc/$1/ns/mnt")" != "$(stat -Lc %i /proc/self/ns/mnt)" &&
    "$(readlink "/proc/$1/exe")" == */sleep ]]
}

# ------------------------------------------------------------------ bring-up

write_configs() {
  local dir="$1" cgroup="$2" pause="$3"
  mkdir -p "$dir/cni/net.d" "$dir/logs" "$dir/pod-logs" "$dir/kubelet" \
    "$dir/fs/var-lib" "$dir/fs/var-log" "$dir/fs/sysctl" "$dir/cni/ipam"
  cat >"$dir/cni/net.d/10-slimspec.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "slimspec",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "isDefaultGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$dir/cni/ipam",
        "ranges": [[{"subnet": "$NODE_SUBNET", "gateway": "$NODE_IP"}]]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
  cat >"$dir/containerd.toml" <<EOF
version = 2
root = "$CONTAINERD_ROOT"
state = "$dir/containerd-state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$dir/containerd.sock"
[ttrpc]
  address = "$dir/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$dir/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$pause"
  # CAP_SYS_RESOURCE is missing here: without this, runc cannot set the sandbox's
  # oom_score_adj ("can't get final child's PID from pipe: EOF").
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$dir/cni/net.d"
EOF
  cat >"$dir/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: true
cgroupRoot: /$cgroup
containerRuntimeEndpoint: unix://$dir/containerd.sock
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
# Reachable only inside the node's namespace (the API server's proxy for logs, exec
# and port-forward): no client certificates needed.
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
# kubelet would set host-wide sysctls; the namespace mounts the expected values.
protectKernelDefaults: true
failSwapOn: false
podLogsDir: $dir/pod-logs
resolvConf: /etc/resolv.conf
serializeImagePulls: false
# A shared build machine: never evict or garbage-collect images for disk pressure.
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
nodeStatusUpdateFrequency: 2s
nodeStatusReportFrequency: 10s
syncFrequency: 10s
fileCheckFrequency: 10s
maxPods: 60
EOF
  cat >"$dir/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: $dir/kube-proxy.kubeconfig
mode: iptables
clusterCIDR: $POD_CIDR
hostnameOverride: $NODE_NAME
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# 0: leave the (host-wide) conntrack table size and timeouts alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
iptables: {localhostNodePorts: false, masqueradeAll: false}
EOF
}

# Inside the new namespaces: lo, the bridge (its address is the node IP), a route for
# Service addresses (connect() needs one before kube-proxy's DNAT), forwarding, and
# private /run, /var/lib, /var/log and sysctl files.
setup_inside() {
  local dir="$1"
  node_vars "$(state "$dir" NODE_INDEX)"
  ip link set lo up
  ip link add "$BRIDGE" type bridge
  ip addr add "$NODE_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  ip route add "$SERVICE_CIDR" dev "$BRIDGE" src "$NODE_IP"
  echo 1 >/proc/sys/net/ipv4/ip_forward
  mount -t tmpfs -o mode=0755 tmpfs /run
  mkdir -p /run/netns /run/containerd
  mount --bind "$dir/fs/var-lib" /var/lib
  mount --bind "$dir/fs/var-log" /var/log
  # kubelet (protectKernelDefaults) checks these host-wide values; the namespace sees
  # files that hold them, the host keeps its own.
  local kv key want
  for kv in kernel/panic=10 kernel/panic_on_oops=1 vm/overcommit_memory=1 vm/panic_on_oom=0 \
    kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
    key="${kv%%=*}" want="${kv#*=}"
    if [[ "$(cat "/proc/sys/$key")" != "$want" ]]; then
      echo "$want" >"$dir/fs/sysctl/${key//\//.}"
      mount --bind "$dir/fs/sysctl/${key//\//.}" "/proc/sys/$key"
    fi
  done
}

make_cgroups() {
  local cgroup="$1" h
  for h in /sys/fs/cgroup/*/; do
    [[ -e "$h/cgroup.procs" ]] || continue
    mkdir -p "$h$cgroup"
    if [[ -e "$h/cpuset.cpus" ]]; then # v1 cpuset: a child starts empty
      cat "$h/cpuset.cpus" >"$h$cgroup/cpuset.cpus"
      cat "$h/cpuset.mems" >"$h$cgroup/cpuset.mems"
    fi
  done
  # On a real node the pods' cgroup sits at the top with CPU shares for the node's
  # capacity; under a default-weight child cgroup every pod together would weigh as
  # much as one busy process of the host.
  if [[ -e "/sys/fs/cgroup/cpu/$cgroup/cpu.shares" ]]; then
    echo $(($(nproc) * 1024)) >"/sys/fs/cgroup/cpu/$cgroup/cpu.shares"
  fi
}

start_daemon() { # start_daemon DIR NAME CMD...: in the namespace, detached, logged
  local dir="$1" name="$2"
  shift 2
  local holder
  holder="$(state "$dir" HOLDER_PID)"
  # nsenter and setsid exec (no fork): $! is the daemon itself.
  if [[ -n "$holder" ]]; then
    nsenter -t "$holder" -n -m -- setsid "$@" </dev/null >>"$dir/logs/$name.log" 2>&1 9>&- &
  else
    setsid "$@" </dev/null >>"$dir/logs/$name.log" 2>&1 9>&- &
  fi
  echo "$!" >"$dir/$name.pid"
}

wait_for() { # wait_for SECONDS WHAT CMD...
  local secs="$1" what="$2" i
  shift 2
  for ((i = 0; i < secs * 5; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  log "timed out after ${secs}s waiting for $what"
  return 1
}

start_containerd() {
  local dir="$1"
  start_daemon "$dir" containerd containerd --config "$dir/containerd.toml"
  wait_for 60 containerd ctr_ "$dir" version || { tail -20 "$dir/logs/containerd.log" >&2; return 1; }
}

stop_pidfile() { # stop_pidfile FILE [SECONDS]: TERM, then KILL
  local pid i
  pid="$(cat "$1" 2>/dev/null)" || return 0
  if alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < ${2:-10} * 5; i++)); do
      alive "$pid" || break
      sleep 0.2
    done
    # `|| true`: it may exit between the check and the kill (errexit would end
    # the script here without a word).
    if alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$1"
}

# Containers left in the image store's metadata by a run that was killed: remove
# them, then restart containerd so its CRI plugin forgets them too.
remove_containers() {
  local dir="$1" id
  for id in $(ctr_ "$dir" tasks ls -q 2>/dev/null); do
    ctr_ "$dir" tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
  done
  for id in $(ctr_ "$dir" tasks ls -q 2>/dev/null); do
    ctr_ "$dir" tasks delete -f "$id" >/dev/null 2>&1 || true
  done
  for id in $(ctr_ "$dir" containers ls -q 2>/dev/null); do
    ctr_ "$dir" containers delete "$id" >/dev/null 2>&1 || true
  done
}

has_image() { [[ -n "$(ctr_ "$1" images ls -q "name==docker.io/$2" 2>/dev/null)" ]]; }

# Images go into the node's containerd without a registry, once per content tag
# (the tags are content hashes: images.sh); tags of older builds are removed.
import_images() {
  local dir="$1" want=() key tag started=0 rc=0
  while IFS='=' read -r key tag; do
    key="${key%_IMAGE}"
    [[ " $NODE_IMAGES " == *" ${key,,} "* ]] && want+=("$tag")
  done < <(bash "$HERE/images.sh" tags)
  for tag in "${want[@]}"; do
    has_image "$dir" "$tag" && continue
    if ((started == 0)) && ! DOCKER_HOST="unix://$SLIMSPEC_CACHE/docker/docker.sock" \
      /usr/bin/docker version >/dev/null 2>&1; then
      bash "$HERE/dockerd.sh" start >/dev/null
      started=1
    fi
    local t0=$SECONDS
    DOCKER_HOST="unix://$SLIMSPEC_CACHE/docker/docker.sock" /usr/bin/docker save "$tag" |
      ctr_ "$dir" images import - >/dev/null || rc=$?
    ((rc == 0)) || { log "import of $tag failed (run scripts/testbed/images.sh)"; break; }
    log "imported $tag in $((SECONDS - t0))s"
  done
  ((started)) && bash "$HERE/dockerd.sh" stop
  ((rc == 0)) || return "$rc"
  # Older builds of the same images: the next run cannot use them.
  local have
  for tag in "${want[@]}"; do
    for have in $(ctr_ "$dir" images ls -q | grep "^docker.io/${tag%%:*}:" || true); do
      [[ "$have" == "docker.io/$tag" ]] || ctr_ "$dir" images rm --sync "$have" >/dev/null
    done
  done
}

watchdog() { # holds the node lock for the run; tears the node down when its owner exits
  local dir="$1" owner="$2"
  node_vars "$3"
  exec 9>"$NODE_LOCK"
  flock 9
  echo "$$" >"$dir/watchdog.pid"
  : >"$dir/locked"
  # (An owner that died while this waited for the lock ends the run at once.)
  while alive "$owner" && [[ ! -e "$dir/stopping" ]]; do sleep 2; done
  [[ -e "$dir/stopping" ]] || bash "$HERE/node.sh" down "$dir" >>"$NODE_CACHE/watchdog.log" 2>&1
}

up() {
  local dir="$1" owner="$2"
  node_vars "${3:-0}"
  mkdir -p "$NODE_CACHE" "$dir"
  echo "$owner" >"$dir/owner.pid"
  cleanup_stale
  # Wait for the node lock (another run's node), then keep it in the watchdog.
  setsid bash "$HERE/node.sh" _watchdog "$dir" "$owner" "$NODE_INDEX" </dev/null >/dev/null 2>&1 &
  local i
  for ((i = 0; i < 3600 * 5; i++)); do
    [[ -e "$dir/locked" ]] && break
    ((i % 150 == 149)) && log "waiting for another test run's node to finish ($NODE_LOCK)"
    sleep 0.2
  done
  [[ -e "$dir/locked" ]] || { log "node lock not acquired"; return 1; }
  local cgroup
  cgroup="$(basename "$dir")"
  local pause
  pause="$(bash "$HERE/images.sh" tags | sed -n 's/^PAUSE_IMAGE=//p')"
  write_configs "$dir" "$cgroup" "$pause"
  setsid unshare --net --mount --propagation private sleep infinity </dev/null >/dev/null 2>&1 9>&- &
  local holder=$!
  wait_for 10 "the namespace holder" holder_ready "$holder"
  cat >"$dir/state.env" <<EOF
HOLDER_PID=$holder
NETNS_INODE=$(stat -Lc %i "/proc/$holder/ns/net")
CGROUP=$cgroup
OWNER_PID=$owner
NODE_INDEX=$NODE_INDEX
NODE_NAME=$NODE_NAME
NODE_IP=$NODE_IP
POD_CIDR=$NODE_SUBNET
SERVICE_CIDR=$SERVICE_CIDR
EOF
  in_ns "$dir" bash "$HERE/node.sh" _setup_inside "$dir"
  make_cgroups "$cgroup"
  mkdir -p "$CONTAINERD_ROOT"
  step "node: containerd" start_containerd "$dir"
  if [[ -n "$(ctr_ "$dir" containers ls -q)" ]]; then
    step "node: remove containers a killed run left" remove_containers "$dir"
    stop_pidfile "$dir/containerd.pid"
    step "node: containerd (restarted)" start_containerd "$dir"
  fi
  step "node: images into containerd (by content tag)" import_images "$dir"
  echo "$dir"
}

# The images into store 0 with a containerd of its own (no namespaces: importing
# needs no network), holding the store's lock like a node does; then store 1 as a
# clone of it.
import_only() {
  mkdir -p "$NODE_CACHE" "$CONTAINERD_ROOT"
  exec 9>"$NODE_LOCK"
  flock 9
  local dir
  # With the lock held no other import runs, so a live import daemon is one a killed
  # import left: it holds store 0's database, and the next one would wait on it forever.
  for dir in /tmp/"$RUN_PREFIX"import-*/; do
    [[ -d "$dir" ]] || continue
    log "stopping the containerd of a killed image import: ${dir%/}"
    stop_pidfile "$dir/containerd.pid"
    rm -rf "$dir"
  done
  dir="$(mktemp -d "/tmp/${RUN_PREFIX}import-XXXXXX")"
  write_configs "$dir" unused "$(bash "$HERE/images.sh" tags | sed -n 's/^PAUSE_IMAGE=//p')"
  local rc=0 images=""
  start_containerd "$dir" && import_images "$dir" || rc=$?
  ((rc == 0)) && images="$(ctr_ "$dir" images ls -q | sort)"
  stop_pidfile "$dir/containerd.pid"
  rm -rf "$dir"
  ((rc == 0)) || return "$rc"
  clone_store "$images"
}

# Store 1 = store 0, hard-linked: layer blobs and unpacked snapshots are never written
# in place (a container writes to its own new upper dir), so they can be shared; every
# other file (the metadata databases, CRI state) gets its own copy. Redone only when
# store 0's image list changed. Called with store 0's lock held and its daemon stopped
# (a consistent copy of its databases).
clone_store() {
  local images="$1" src="$CONTAINERD_ROOT" dst="$NODE_CACHE/containerd-1"
  exec 8>"$NODE_CACHE/.lock-1"
  flock 8
  if [[ -d "$dst" && "$(cat "$dst.images" 2>/dev/null)" == "$images" ]]; then
    return 0
  fi
  local t0=$SECONDS
  rm -rf "$dst" "$dst.new" "$dst.images"
  cp -al "$src" "$dst.new"
  find "$dst.new" -type f \
    -not -path "$dst.new/io.containerd.content.v1.content/blobs/*" \
    -not -path "$dst.new/io.containerd.snapshotter.v1.overlayfs/snapshots/*" \
    -exec sh -c 'for f; do cp -p "$f" "$f.own" && mv -f "$f.own" "$f"; done' _ {} +
  mv "$dst.new" "$dst"
  echo "$images" >"$dst.images"
  log "store 1 cloned from store 0 (hard links) in $((SECONDS - t0))s"
}

# Two nodes' namespaces joined by a veth pair; each routes the other's pod range
# over it (pod to pod, node to pod, kubelet to the API server in node 0's namespace).
link() {
  local a="$1" b="$2" ha hb ia ib
  ha="$(state "$a" HOLDER_PID)" hb="$(state "$b" HOLDER_PID)"
  ia="$(state "$a" NODE_INDEX)" ib="$(state "$b" NODE_INDEX)"
  ip link add "peer$ib" netns "$ha" type veth peer name "peer$ia" netns "$hb"
  nsenter -t "$ha" -n -- sh -ec "ip addr add $LINK_NET.$((ia + 1))/24 dev peer$ib
    ip link set peer$ib up
    ip route add 10.244.$ib.0/24 via $LINK_NET.$((ib + 1))"
  nsenter -t "$hb" -n -- sh -ec "ip addr add $LINK_NET.$((ib + 1))/24 dev peer$ia
    ip link set peer$ia up
    ip route add 10.244.$ia.0/24 via $LINK_NET.$((ia + 1))"
}

start() {
  local dir="$1" b
  node_vars "$(state "$dir" NODE_INDEX)"
  for b in kubelet kube-proxy; do
    [[ -x "$K8S_NODE_DIR/$b" ]] || { log "$b missing: bash scripts/testbed/install.sh node"; return 1; }
    [[ -f "$dir/$b.kubeconfig" ]] || { log "$dir/$b.kubeconfig missing"; return 1; }
  done
  start_daemon "$dir" kubelet "$K8S_NODE_DIR/kubelet" --config="$dir/kubelet.yaml" \
    --kubeconfig="$dir/kubelet.kubeconfig" --hostname-override="$NODE_NAME" \
    --node-ip="$NODE_IP" --root-dir="$dir/kubelet" --cert-dir="$dir/kubelet/pki" --v=1
  start_daemon "$dir" kube-proxy "$K8S_NODE_DIR/kube-proxy" --config="$dir/kube-proxy.yaml" --v=1
  wait_for 60 "kubelet /healthz" in_ns "$dir" curl -sf http://127.0.0.1:10248/healthz ||
    { tail -30 "$dir/logs/kubelet.log" >&2; return 1; }
}

# ------------------------------------------------------------------ tear-down

netns_pids() { # PIDs whose network namespace is the node's
  local inode="$1" p
  for p in /proc/[0-9]*; do
    [[ "$(stat -Lc %i "$p/ns/net" 2>/dev/null)" == "$inode" ]] && echo "${p#/proc/}"
  done
}

cgroup_pids() { # PIDs in the run's cgroups (pods, in their own network namespaces)
  local cgroup="$1"
  [[ -n "$cgroup" ]] || return 0
  find /sys/fs/cgroup/*/"$cgroup" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u
}

down() {
  local dir="$1"
  [[ -f "$dir/state.env" ]] || { rm -rf "$dir"; return 0; }
  exec 6>"$dir/down.lock"
  flock 6
  [[ -f "$dir/state.env" ]] || return 0
  : >"$dir/stopping"
  local holder inode cgroup
  holder="$(state "$dir" HOLDER_PID)" inode="$(state "$dir" NETNS_INODE)" cgroup="$(state "$dir" CGROUP)"
  stop_pidfile "$dir/kube-proxy.pid"
  stop_pidfile "$dir/kubelet.pid"
  if alive "$holder" && [[ -S "$dir/containerd.sock" ]]; then
    remove_containers "$dir"
  fi
  stop_pidfile "$dir/containerd.pid"
  # Whatever is left (shims and pods of a killed run; processes the tests started in
  # the namespace): by network namespace and by the run's cgroups.
  local round pids
  for round in 1 2 3 4 5 6 7 8 9 10; do
    pids="$( (netns_pids "$inode"; cgroup_pids "$cgroup") | grep -vx "$holder" | sort -u || true)"
    [[ -z "$pids" ]] && break
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    sleep 0.3
  done
  if alive "$holder"; then kill -KILL "$holder" 2>/dev/null || true; fi
  # The namespaces go with their last process: interfaces, iptables rules and every
  # mount made inside (pod volumes, /run, /var/lib, sysctl files) with them.
  local h
  for round in 1 2 3 4 5; do
    for h in /sys/fs/cgroup/*/; do
      [[ -d "$h$cgroup" ]] && find "$h$cgroup" -depth -type d -exec rmdir {} + 2>/dev/null
    done
    compgen -G "/sys/fs/cgroup/*/$cgroup" >/dev/null || break
    sleep 0.5
  done
  if compgen -G "/sys/fs/cgroup/*/$cgroup" >/dev/null; then
    log "cgroups of $cgroup could not be removed"
  fi
  rm -f "$dir/state.env"
  if [[ "${SLIMSPEC_TESTBED_KEEP:-0}" != 1 ]]; then
    rm -rf "$dir"
  fi
}

cleanup_stale() {
  local dir owner watchdog
  for dir in /tmp/"$RUN_PREFIX"*/; do
    dir="${dir%/}"
    if [[ "$dir" == /tmp/"$RUN_PREFIX"import-* ]]; then
      # an image import killed before its own clean-up (it has no owner or state):
      # gone once its containerd is
      alive "$(cat "$dir/containerd.pid" 2>/dev/null || true)" || rm -rf "$dir"
      continue
    fi
    # `|| true`: a folder killed before it recorded anything has neither file
    owner="$(cat "$dir/owner.pid" 2>/dev/null || state "$dir" OWNER_PID || true)"
    watchdog="$(cat "$dir/watchdog.pid" 2>/dev/null || true)"
    if [[ -f "$dir/state.env" ]]; then
      if ! alive "$owner" || ! alive "$watchdog"; then
        log "tearing down a previous run's node: $dir"
        down "$dir"
      fi
    elif [[ -n "$owner" ]] && ! alive "$owner" && ! alive "$watchdog"; then
      rm -rf "$dir" # killed before its namespaces existed
    fi
  done
}

case "${1:-}" in
  up) up "$2" "$3" "${4:-0}" ;;
  link) link "$2" "$3" ;;
  start) start "$2" ;;
  down) down "$2" ;;
  exec) dir="$2"; shift 2; in_ns "$dir" "$@" ;;
  import) import_only ;;
  cleanup) cleanup_stale ;;
  _setup_inside) setup_inside "$2" ;;
  _watchdog) watchdog "$2" "$3" "${4:-0}" ;;
  *) sed -n '2,/^$/p' "$0" >&2; exit 2 ;;
esac
