#!/usr/bin/env bash
# Builds the real etcd and kube-apiserver the Kubernetes tests run against (controller-runtime envtest
# through KUBEBUILDER_ASSETS), from the wrapper modules under test/k8s/, once per machine: it does nothing
# when both binaries of the pinned versions exist. A cold kube-apiserver build takes ~10 CPU-minutes.
#
#   scripts/k8s-test-bins.sh          build if missing, print the assets directory
#   scripts/k8s-test-bins.sh dir      print the assets directory only
#
# Tests find the binaries through $KUBEBUILDER_ASSETS or this directory and skip, saying so, without them.
set -euo pipefail
cd "$(dirname "$0")/.."

GO=${GO:-go}
# The pinned version of module $2 in go.mod $1 (a single require line or inside a require block).
pinned() { awk -v m="$2" '($1=="require" && $2==m) {print $3; exit} ($1==m) {print $2; exit}' "$1"; }
kas=$(pinned test/k8s/kube-apiserver/go.mod k8s.io/kubernetes)
etcd=$(pinned test/k8s/etcd/go.mod go.etcd.io/etcd/server/v3)
[ -n "$kas" ] && [ -n "$etcd" ] || { echo "k8s-test-bins: cannot read the pinned versions from test/k8s/*/go.mod" >&2; exit 1; }
cache=${XDG_CACHE_HOME:-$HOME/.cache}
dir=${AENV_K8S_ASSETS:-$cache/aenv/k8s-assets/kube-$kas-etcd-$etcd}

if [ "${1:-}" = dir ]; then echo "$dir"; exit 0; fi

mkdir -p "$dir"
if [ ! -x "$dir/etcd" ]; then
  echo "k8s-test-bins: building etcd $etcd" >&2
  (cd test/k8s/etcd && CGO_ENABLED=0 $GO build -trimpath -ldflags='-s -w' -o "$dir/etcd.tmp" .)
  mv "$dir/etcd.tmp" "$dir/etcd"
fi
if [ ! -x "$dir/kube-apiserver" ]; then
  echo "k8s-test-bins: building kube-apiserver $kas (~10 CPU-minutes cold)" >&2
  (cd test/k8s/kube-apiserver && CGO_ENABLED=0 $GO build -trimpath -ldflags='-s -w' -o "$dir/kube-apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver)
  mv "$dir/kube-apiserver.tmp" "$dir/kube-apiserver"
fi
echo "$dir"
