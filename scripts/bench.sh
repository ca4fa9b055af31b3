#!/usr/bin/env bash
# make bench: the benchmarks, with the baselines measured in the same run.
#
# Installs the benchmark-only packages (Open MPI, Debian's python3-torch for
# gloo), then measures the baselines of ../shared/baselines (memory bandwidth,
# Open MPI MPI_Allreduce, torch.distributed gloo, ucx_perftest) on this machine
# into BUILD_DIR/bench/baselines/RESULTS.md, then Tandem's own benchmarks
# (the coordinator, the collectives, the optimizer, the parameter server,
# training) into BUILD_DIR/bench/, prints the collectives beside the
# baselines with their ratios, and charts the all-reduce and the parameter
# server as SVG (scripts/plot.py; see docs/benchmarks.md).
#
# Usage: scripts/bench.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build}"
BASELINES="${TANDEM_BASELINES:-$(cd .. && pwd)/shared/baselines}"
OUT="$BUILD_DIR/bench"

BENCH_PACKAGES=(openmpi-bin libopenmpi-dev python3-torch ucx-utils util-linux gcc)
missing=()
for p in "${BENCH_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "bench: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ ! -f "$BASELINES/run.sh" ]; then
  echo "bench: no baseline scripts at $BASELINES (set TANDEM_BASELINES to their folder)" >&2
  exit 1
fi
mkdir -p "$OUT/baselines"
echo "bench: measuring the baselines into $OUT/baselines (about 2 minutes)"
OUT_DIR="$(pwd)/$OUT/baselines" BUILD_DIR="$(pwd)/$OUT/baselines-build" bash "$BASELINES/run.sh"
echo
echo "bench: baselines written to $OUT/baselines/RESULTS.md"

echo
echo "bench: coordinator (docs/benchmarks.md)"
{
  "$BUILD_DIR/bin/tandem" bench coordinator --workers 4096 --kill 1 --json
  "$BUILD_DIR/bin/tandem" bench coordinator --workers 4096 --heartbeat-interval 400ms --duration 10s --json
  "$BUILD_DIR/bin/tandem" bench coordinator --workers 65 --kill 1 --json
} | tee "$OUT/coordinator.jsonl"
echo "bench: coordinator results in $OUT/coordinator.jsonl"

echo
echo "bench: collectives (docs/benchmarks.md): allreduce, float32 sum, 2 and 4 processes"
{
  "$BUILD_DIR/bin/tandem" bench allreduce --np 2 --min-bytes 8 --max-bytes 256MiB --iters 20 --warmup 5 --json
  "$BUILD_DIR/bin/tandem" bench allreduce --np 4 --min-bytes 4KiB --max-bytes 64MiB --factor 4 --iters 20 --warmup 5 --json
} | tee "$OUT/allreduce.jsonl"
echo
echo "bench: Tandem beside the baselines of this run"
python3 scripts/bench_compare.py "$OUT/baselines/raw-results.txt" "$OUT/allreduce.jsonl" "$OUT/allreduce.md"
python3 scripts/plot.py allreduce "$OUT/allreduce.jsonl" --baselines "$OUT/baselines/raw-results.txt" -o "$OUT/allreduce.svg"
echo "bench: written to $OUT/allreduce.md and $OUT/allreduce.svg"

# The host's speed drifts over minutes, and the baselines above ran minutes
# before Tandem: alternate them, one right after the other, and judge each
# size by the median of the rounds.
ROUNDS="${TANDEM_BENCH_ROUNDS:-5}"
echo
echo "bench: all-reduce, 2 ranks, $ROUNDS rounds of: the three Open MPI shared-memory variants, then Tandem"
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --mca oob_tcp_if_include lo --mca pml ob1 -np 2 --mca btl self,vader)
MPI_BIN="$OUT/baselines-build/mpi_allreduce"
: > "$OUT/allreduce-rounds.txt"
for r in $(seq 1 "$ROUNDS"); do
  echo "bench: round $r/$ROUNDS"
  {
    echo "# round $r"
    "${MPIRUN[@]}" "$MPI_BIN" shm-vader 20 5 | grep '^RESULT'
    "${MPIRUN[@]}" --mca btl_vader_single_copy_mechanism none "$MPI_BIN" shm-vader-nocma 20 5 | grep '^RESULT'
    "${MPIRUN[@]}" --mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4 \
      "$MPI_BIN" shm-vader-ring 20 5 | grep '^RESULT'
    "$BUILD_DIR/bin/tandem" bench allreduce --np 2 --min-bytes 4KiB --max-bytes 64MiB --factor 4 --iters 20 --warmup 5 --json
  } >> "$OUT/allreduce-rounds.txt"
done
python3 scripts/bench_compare.py --rounds "$OUT/allreduce-rounds.txt" "$OUT/allreduce-rounds.md"
echo "bench: written to $OUT/allreduce-rounds.md"

echo
echo "bench: optimizer (docs/benchmarks.md): AdamW on the parameter server's fp32 buffers, beside the memory bandwidth and torch.optim"
"$BUILD_DIR/bin/tandem" bench optimizer --optimizer adamw --params 1M,16M,64M --iters 10 --warmup 2 --json | tee "$OUT/optimizer.jsonl"
echo "bench: optimizer results in $OUT/optimizer.jsonl"

echo
echo "bench: parameter server (docs/benchmarks.md): push and pull goodput over the real data path, beside ucx_perftest on the same transports"
"$BUILD_DIR/bin/tandem" bench ps --min-bytes 64KiB --max-bytes 64MiB --factor 4 --iters 20 --warmup 5 --rounds 3 --json | tee "$OUT/ps.jsonl"
python3 scripts/plot.py ps "$OUT/ps.jsonl" -o "$OUT/ps.svg"
echo "bench: parameter-server results in $OUT/ps.jsonl and $OUT/ps.svg"

echo
echo "bench: training (docs/benchmarks.md): tokens/s of each mode beside one process, and the exposed communication"
"$BUILD_DIR/bin/tandem" bench train --json | tee "$OUT/train.jsonl"
echo "bench: training results in $OUT/train.jsonl"
