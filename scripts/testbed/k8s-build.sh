# Building Kubernetes binaries from its Go modules, shared by install.sh (the
# current version) and install-floor.sh (the oldest supported one). Source it.

# Go's module and build caches live in our cache too, so CI can cache one dir
# and a rebuild after a cache wipe of ~/.cache/go-build is not needed. The
# caller sets GOTOOLCHAIN (the Go that version of Kubernetes needs).
export GOMODCACHE="$SLIMSPEC_CACHE/go/mod"
export GOCACHE="$SLIMSPEC_CACHE/go/build"
export GOFLAGS="-modcacherw -buildvcs=false"
export GOPROXY="${GOPROXY:-https://proxy.golang.org,direct}"
export CGO_ENABLED=0

# write_k8s_module SRC VERSION GO_DIRECTIVE STAGING_VERSION CMD...: a scratch
# module in SRC that requires k8s.io/kubernetes VERSION, pins every staging
# module (required there at v0.0.0) to STAGING_VERSION, and gets the commands.
write_k8s_module() {
  local src="$1" version="$2" directive="$3" staging_version="$4" mod_file staging cmd
  shift 4
  mkdir -p "$src"
  cd "$src"
  printf 'module slimspec.local/k8sbuild\n\ngo %s\n\nrequire k8s.io/kubernetes %s\n' \
    "$directive" "$version" >go.mod
  mod_file="$(go mod download -json "k8s.io/kubernetes@$version" |
    sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')"
  staging="$(awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$mod_file" | sort -u)"
  [[ -n "$staging" ]] || { echo "no staging modules found in $mod_file" >&2; return 1; }
  {
    echo
    echo "replace ("
    for m in $staging; do echo "	$m => $m $staging_version"; done
    echo ")"
  } >>go.mod
  local pkgs=()
  for cmd in "$@"; do pkgs+=("k8s.io/kubernetes/cmd/$cmd@$version"); done
  go get "${pkgs[@]}"
}

# k8s_ldflags VERSION: stamp the version the binaries report (`--version`).
k8s_ldflags() {
  local minor pkg=k8s.io/component-base/version
  minor="$(echo "$1" | cut -d. -f2)"
  echo "-s -w -X $pkg.gitVersion=$1 -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
}
