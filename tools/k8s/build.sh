#!/usr/bin/env bash
# Build the real Kubernetes-side programs that IT-Bench's CISO scenarios use, from
# Go modules, at pinned versions, into a cache outside the clone:
#
#   ${CMBS_TOOLS_DIR:-$HOME/.cache/cmbs-tools}/bin
#
# A program whose pinned build is already there is skipped, so a second run costs
# next to nothing. See README.md beside this file for versions and timings.
#
# Usage: tools/k8s/build.sh [PROGRAM...]     (default: all of them)
#        tools/k8s/build.sh --bin-dir        (print the bin directory and exit)
#        tools/k8s/build.sh --list           (print the programs and their versions)
#
# Environment:
#   CMBS_TOOLS_DIR    cache root (default $HOME/.cache/cmbs-tools)
#   CMBS_TOOLS_JOBS   go build -p and GOMAXPROCS (default 1: the machine is shared)
#   CMBS_TOOLS_NICE   nice level of the go commands (default 19)
#   GOCACHE, GOMODCACHE, GOPROXY: the go command's own defaults are used and kept.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# ---- pinned versions -------------------------------------------------------------
OPA_VERSION=v1.22.3        # github.com/open-policy-agent/opa
ETCD_VERSION=v3.6.16       # go.etcd.io/etcd/server/v3 (pinned in etcd/go.mod)
K8S_VERSION=v1.36.3        # k8s.io/kubernetes (pinned in kubernetes/go.mod)
KYVERNO_VERSION=v1.19.1    # github.com/kyverno/kyverno (pinned in kyverno/go.mod)

# name | version | wrapper dir ("-" = go install pkg@version) | package
PROGRAMS=(
  "opa|$OPA_VERSION|-|github.com/open-policy-agent/opa"
  "etcd|$ETCD_VERSION|etcd|go.etcd.io/etcd/server/v3"
  "kubectl|$K8S_VERSION|kubernetes|k8s.io/kubernetes/cmd/kubectl"
  "kube-apiserver|$K8S_VERSION|kubernetes|k8s.io/kubernetes/cmd/kube-apiserver"
  "kube-controller-manager|$K8S_VERSION|kubernetes|k8s.io/kubernetes/cmd/kube-controller-manager"
  "kyverno|$KYVERNO_VERSION|kyverno|github.com/kyverno/kyverno/cmd/cli/kubectl-kyverno"
  "kyverno-reports-controller|$KYVERNO_VERSION|kyverno|github.com/kyverno/kyverno/cmd/reports-controller"
)

TOOLS_DIR=${CMBS_TOOLS_DIR:-$HOME/.cache/cmbs-tools}
BIN=$TOOLS_DIR/bin
STAMPS=$TOOLS_DIR/stamps
LOGS=$TOOLS_DIR/logs
JOBS=${CMBS_TOOLS_JOBS:-1}
NICE=${CMBS_TOOLS_NICE:-19}

case "${1:-}" in
  --bin-dir) echo "$BIN"; exit 0 ;;
  --list) for p in "${PROGRAMS[@]}"; do IFS='|' read -r n v _ _ <<<"$p"; echo "$n $v"; done; exit 0 ;;
  -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac

command -v go >/dev/null 2>&1 || { echo "tools/k8s/build.sh: FAILED: no 'go' on PATH (Go 1.26 is needed)" >&2; exit 1; }

# Which programs: the arguments, or all.
WANT=()
if [ "$#" -gt 0 ]; then
  for a in "$@"; do
    found=0
    for p in "${PROGRAMS[@]}"; do [ "${p%%|*}" = "$a" ] && { WANT+=("$p"); found=1; }; done
    [ "$found" = 1 ] || { echo "tools/k8s/build.sh: FAILED: unknown program '$a' (see --list)" >&2; exit 2; }
  done
else
  WANT=("${PROGRAMS[@]}")
fi

mkdir -p "$BIN" "$STAMPS" "$LOGS"

# One build at a time per cache (a test run and CI may call this together).
exec 9>"$TOOLS_DIR/.lock"
flock 9

export GOMAXPROCS=$JOBS CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false
GOVERSION=$(go env GOVERSION)

TMP=""
cleanup() { [ -z "$TMP" ] || rm -rf "$TMP"; }
trap cleanup EXIT

# What a build depends on: name, version, Go, and the wrapper module's go.mod/go.sum.
stamp_of() { # name version dir
  local s="$1 $2 $GOVERSION"
  if [ "$3" != "-" ]; then
    s="$s $(cat "$HERE/$3/go.mod" "$HERE/$3/go.sum" | sha256sum | cut -c1-16)"
  fi
  echo "$s"
}

ldflags_of() { # name version
  case "$1" in
    kubectl|kube-apiserver|kube-controller-manager)
      local v=${2#v} x
      local maj=${v%%.*} rest=${v#*.}; local min=${rest%%.*}
      x=""
      for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        x="$x -X $pkg.gitVersion=$2 -X $pkg.gitMajor=$maj -X $pkg.gitMinor=$min -X $pkg.gitTreeState=clean"
      done
      echo "-s -w$x" ;;
    kyverno|kyverno-reports-controller)
      echo "-s -w -X github.com/kyverno/kyverno/pkg/version.BuildVersion=$2" ;;
    *) echo "-s -w" ;;
  esac
}

# How each program tells its version (used as a smoke test after building).
version_args() {
  case "$1" in
    opa|kyverno) echo "version" ;;
    kubectl) echo "version --client" ;;
    kyverno-reports-controller) echo "--help" ;;  # no version flag; logs it at start
    *) echo "--version" ;;
  esac
}

TOTAL_START=$(date +%s)
for p in "${WANT[@]}"; do
  IFS='|' read -r name version dir pkg <<<"$p"
  want_stamp=$(stamp_of "$name" "$version" "$dir")
  if [ -x "$BIN/$name" ] && [ -f "$STAMPS/$name" ] && [ "$(cat "$STAMPS/$name")" = "$want_stamp" ]; then
    echo "cached $name $version 0s"
    continue
  fi
  start=$(date +%s)
  log="$LOGS/$name.log"
  TMP=$(mktemp -d "$BIN/.build-$name.XXXXXX")
  ldflags=$(ldflags_of "$name" "$version")
  rc=0
  if [ "$dir" = "-" ]; then
    # A module without replace directives: go install at the pinned version.
    ( cd "$TMP" && GOBIN="$TMP" nice -n "$NICE" go install -p "$JOBS" -trimpath \
        -ldflags "$ldflags" "$pkg@$version" ) >"$log" 2>&1 || rc=$?
    built="$TMP/$(basename "$pkg")"
  else
    ( cd "$HERE/$dir" && nice -n "$NICE" go build -p "$JOBS" -trimpath -mod=readonly \
        -ldflags "$ldflags" -o "$TMP/$name" "$pkg" ) >"$log" 2>&1 || rc=$?
    built="$TMP/$name"
  fi
  secs=$(( $(date +%s) - start ))
  if [ "$rc" != 0 ] || [ ! -x "$built" ]; then
    echo "FAILED $name $version after ${secs}s (go exit $rc); last lines of $log:" >&2
    tail -n 15 "$log" >&2 || true
    exit 1
  fi
  # It must at least start and tell its version.
  # shellcheck disable=SC2046
  if ! "$built" $(version_args "$name") >>"$log" 2>&1; then
    echo "FAILED $name $version after ${secs}s: the built program does not run (see $log)" >&2
    exit 1
  fi
  mv -f "$built" "$BIN/$name"
  echo "$want_stamp" >"$STAMPS/$name"
  rm -rf "$TMP"; TMP=""
  echo "built $name $version ${secs}s"
done
echo "done in $(( $(date +%s) - TOTAL_START ))s: $BIN"
