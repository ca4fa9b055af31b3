#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU: prints the GPUs and the
# NCCL version, builds the GPU test binaries if needed (configuring BUILD_DIR
# with -DTANDEM_WITH_CUDA=ON if it is not configured yet), then runs
# gpu_test and nccl_communicator_test with TANDEM_REQUIRE_GPU=1, so that a GPU
# test that would skip for want of a device fails instead. Tests that need two
# devices still skip on a machine with one.
#
# Usage: scripts/gpu-check.sh [BUILD_DIR]        (default: build)
# Environment: TANDEM_CUDA_ROOT (default /usr/local/cuda), NCCL_DEBUG (default WARN),
#              GTEST_FILTER (passed on to the test binaries).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build}"
CUDA_ROOT="${TANDEM_CUDA_ROOT:-/usr/local/cuda}"
TARGETS=(gpu_test nccl_communicator_test)
export PATH="$CUDA_ROOT/bin:$PATH"

echo "== GPUs"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L || echo "gpu-check: nvidia-smi -L failed"
else
  echo "gpu-check: nvidia-smi not found"
fi

echo "== NCCL"
header="$CUDA_ROOT/include/nccl.h"
if [ -f "$header" ]; then
  printf 'nccl.h: %s.%s.%s (%s)\n' \
    "$(awk '/#define NCCL_MAJOR/ {print $3}' "$header")" \
    "$(awk '/#define NCCL_MINOR/ {print $3}' "$header")" \
    "$(awk '/#define NCCL_PATCH/ {print $3}' "$header")" "$header"
else
  echo "gpu-check: no nccl.h under $CUDA_ROOT/include"
fi
for lib in "$CUDA_ROOT"/lib64/libnccl.so.* "$CUDA_ROOT"/lib/libnccl.so.*; do
  [ -f "$lib" ] || continue
  version="$(strings "$lib" 2>/dev/null | awk '/^NCCL version/ && !found { print; found = 1 }')"
  echo "$(basename "$lib"): ${version:-no version string found}"
  break
done

# Build unless the binaries are here and no build tool is (a copied build).
lock() { if command -v flock >/dev/null 2>&1; then flock /tmp/tandem-build.lock "$@"; else "$@"; fi; }
if command -v cmake >/dev/null 2>&1; then
  if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
    echo "== configuring $BUILD_DIR"
    generator=()
    command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
    lock cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DTANDEM_WITH_CUDA=ON -DTANDEM_CUDA_ROOT="$CUDA_ROOT"
  fi
  echo "== building ${TARGETS[*]} in $BUILD_DIR"
  lock cmake --build "$BUILD_DIR" --target "${TARGETS[@]}"
elif [ ! -x "$BUILD_DIR/bin/nccl_communicator_test" ]; then
  echo "gpu-check: no cmake to build with and no $BUILD_DIR/bin/nccl_communicator_test" >&2
  exit 1
fi

config="$BUILD_DIR/generated/tandem/config.h"
if ! grep -q '#define TANDEM_CUDA_ENABLED 1' "$config" 2>/dev/null; then
  echo "gpu-check: $BUILD_DIR was configured without CUDA ($config); reconfigure with -DTANDEM_WITH_CUDA=ON" >&2
  exit 1
fi

export TANDEM_REQUIRE_GPU=1
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
failed=()
for t in "${TARGETS[@]}"; do
  echo "== $t"
  if ! "$BUILD_DIR/bin/$t" ${GTEST_FILTER:+--gtest_filter="$GTEST_FILTER"}; then failed+=("$t"); fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu-check: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "gpu-check: all GPU tests passed"
