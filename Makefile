# Tandem: the commands a user and CI run. See README.md and docs/building.md.
#
#   make deps    install the Debian packages Tandem needs (idempotent)
#   make build   configure and build into build/ (BUILD_TYPE=RelWithDebInfo)
#   make test    deps + build + the whole test suite
#   make demo    train the reference model on a local cluster with `tandem run`
#   make bench   the benchmarks, beside the baselines measured in the same run
#   make clean   remove the build trees
#
# Variables: BUILD_TYPE (Debug, Release, RelWithDebInfo), BUILD_DIR, CUDA
# (AUTO, ON, OFF: the GPU backend), SANITIZE (address,undefined | thread),
# CMAKE_FLAGS (more -D options), CTEST_FLAGS.

BUILD_TYPE ?= RelWithDebInfo
BUILD_DIR  ?= build
CUDA       ?= AUTO
SANITIZE   ?=
CMAKE_FLAGS ?=
CTEST_FLAGS ?=
JOBS       ?= $(shell nproc)

CONFIGURE = cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	-DTANDEM_WITH_CUDA=$(CUDA) -DTANDEM_SANITIZE=$(SANITIZE) $(CMAKE_FLAGS)

.PHONY: all deps build test demo bench clean test-asan test-tsan format format-check tidy

all: build

deps:
	@scripts/deps.sh

build: deps
	@$(CONFIGURE) > /dev/null
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) $(CTEST_FLAGS)

# The same suite under AddressSanitizer and UndefinedBehaviorSanitizer (CUDA
# code is not instrumented, so the GPU backend is left out of this build).
# Built with clang, which also checks the lock annotations: -Wthread-safety,
# and every warning an error (TANDEM_THREAD_SAFETY, see common/mutex.h).
# The failure drills (label "drill": whole clusters for minutes, over the
# code tests/supervisor_test.cc covers) and tests that time a whole cluster's
# steps (label "timed": the straggler test, over the code
# tests/stragglers_test.cc covers) run in `make test` only.
test-asan:
	$(MAKE) test BUILD_DIR=build-asan BUILD_TYPE=Debug CUDA=OFF SANITIZE=address,undefined CTEST_FLAGS="-LE 'drill|timed'" \
		CMAKE_FLAGS="-DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 -DTANDEM_THREAD_SAFETY=ON $(CMAKE_FLAGS)"

# ThreadSanitizer, for Tandem's own concurrent parts (label "concurrency"; see
# tests/concurrency_test.cc for why tests that cross gRPC are left out).
# UCX hooks mmap and madvise at load time, which ThreadSanitizer does not
# survive: the hook is off for every TSan binary, including the test listing
# that runs at build time (tests/CMakeLists.txt sets it for the test runs).
test-tsan:
	UCX_MEM_MMAP_HOOK_MODE=none $(MAKE) test BUILD_DIR=build-tsan BUILD_TYPE=Debug CUDA=OFF SANITIZE=thread CTEST_FLAGS="-L concurrency"

demo: build
	$(BUILD_DIR)/bin/tandem run --nodes 2 --workers-per-node 2 --servers 2 --steps 200 --summary $(BUILD_DIR)/demo-summary.json

bench: build
	@scripts/bench.sh $(BUILD_DIR)

clean:
	rm -rf build build-asan build-tsan

FORMAT_FILES = $(shell git ls-files '*.cc' '*.h' '*.cu' '*.proto')

format:
	clang-format -i $(FORMAT_FILES)

format-check:
	clang-format --dry-run -Werror $(FORMAT_FILES)

tidy: build
	clang-tidy -p $(BUILD_DIR) --quiet $(shell git ls-files '*.cc' | grep -v '^tests/')
