#!/usr/bin/env bash
# Installs the Debian 12 packages Tandem needs to build and test: the one list
# of build and test dependencies. Idempotent: runs apt-get only when something
# is missing. Benchmark-only packages are installed by scripts/bench.sh.
#
# Usage: scripts/deps.sh            (as root, or with sudo available)
set -euo pipefail

PACKAGES=(
  # toolchain
  build-essential cmake ninja-build pkg-config git clang-format clang-tidy
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
  # network namespaces for multi-node tests
  iproute2 procps
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "deps: all ${#PACKAGES[@]} packages are installed"
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# --no-install-recommends keeps 'prometheus' from pulling in its exporters.
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
