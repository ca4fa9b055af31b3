#!/usr/bin/env python3
"""An installed Tandem serves a CMake project of one's own (cmake/TandemInstall.cmake).

1. `cmake --install BUILD --prefix TMP/prefix`, and the layout it promises:
   the programs, libtandem, the public headers, TandemConfig.cmake with its
   version and targets files.
2. Each public header compiles alone with only TMP/prefix/include on the
   include path, and reads no header but the standard library's and the
   other public ones (no gRPC, protobuf, fmt, spdlog, UCX ...).
3. A copy of examples/ (CMakeLists.txt and custom_loop.cc), outside the tree,
   configured with -DCMAKE_PREFIX_PATH=TMP/prefix: find_package(Tandem)
   finds the installed copy and the custom-loop example builds against it.
4. The example built so runs: --help, then two of it train 20 allreduce
   steps under the installed tandem-coordinator and log their loss.

Every step has a time limit; TMP is removed at the end (--keep leaves it).
Exit 0 on success, 1 with the reason on failure.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PUBLIC_HEADERS = ["status.h", "train_config.h", "worker.h"]
PROGRAMS = ["tandem", "tandem-coordinator", "tandem-server", "tandem-worker"]


class Failure(Exception):
    pass


def run(argv, timeout, env=None, cwd=None):
    print("+ " + " ".join(argv), flush=True)
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                           env=env, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        raise Failure(f"{argv[0]} took more than {timeout} s:\n{e.output or ''}")
    if p.returncode != 0:
        raise Failure(f"{' '.join(argv)} exited with {p.returncode}:\n{p.stdout}")
    return p.stdout


def find_libdir(prefix):
    for libdir in ("lib", "lib64", "lib/x86_64-linux-gnu"):
        if os.path.exists(os.path.join(prefix, libdir, "cmake", "Tandem", "TandemConfig.cmake")):
            return os.path.join(prefix, libdir)
    raise Failure(f"no lib*/cmake/Tandem/TandemConfig.cmake under {prefix}")


def check_layout(prefix):
    for program in PROGRAMS:
        path = os.path.join(prefix, "bin", program)
        if not os.access(path, os.X_OK):
            raise Failure(f"{path} was not installed")
    libdir = find_libdir(prefix)
    for name in ("libtandem.so",):
        if not os.path.exists(os.path.join(libdir, name)):
            raise Failure(f"{libdir}/{name} was not installed")
    cmakedir = os.path.join(libdir, "cmake", "Tandem")
    for name in ("TandemConfig.cmake", "TandemConfigVersion.cmake", "TandemTargets.cmake"):
        if not os.path.exists(os.path.join(cmakedir, name)):
            raise Failure(f"{cmakedir}/{name} was not installed")
    installed = sorted(os.listdir(os.path.join(prefix, "include", "tandem")))
    if installed != sorted(PUBLIC_HEADERS):
        raise Failure(f"include/tandem holds {installed}, expected {sorted(PUBLIC_HEADERS)}")
    # The library keeps its dependencies to itself: the exported target links nothing else.
    targets = open(os.path.join(cmakedir, "TandemTargets.cmake")).read()
    if "INTERFACE_LINK_LIBRARIES" in targets:
        raise Failure("Tandem::worker exports link dependencies:\n" + targets)


def allowed_dependency(path, include_dir):
    """Whether a header a public header reads is the standard library's (or libc's) or a public one."""
    path = os.path.normpath(path)
    if path.startswith(include_dir + os.sep):
        return True
    if "/c++/" in path or path.startswith("/usr/lib/gcc/") or path.startswith("/usr/lib/llvm"):
        return True
    if path.startswith("/usr/include/"):
        rest = path[len("/usr/include/"):]
        top = rest.split("/")[0]
        # libc's own headers: the top level and its architecture and kernel directories.
        return "/" not in rest or top in ("x86_64-linux-gnu", "aarch64-linux-gnu", "linux", "asm-generic", "bits",
                                          "sys", "gnu", "asm")
    return False


def check_headers(cxx, prefix, tmp):
    include_dir = os.path.join(prefix, "include")
    for header in PUBLIC_HEADERS:
        source = os.path.join(tmp, "only_" + header.replace(".", "_") + ".cc")
        with open(source, "w") as f:
            f.write(f'#include "tandem/{header}"\n')
        deps = run([cxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-I", include_dir, "-M",
                    source], timeout=60)
        paths = deps.replace("\\\n", " ").split(":", 1)[1].split()
        stray = [p for p in paths if p != source and not allowed_dependency(p, include_dir)]
        if stray:
            raise Failure(f"tandem/{header} reads headers outside the public API and the standard library: {stray}")
        run([cxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-I", include_dir, source], timeout=60)


def build_example(args, prefix, tmp):
    example = os.path.join(tmp, "example")
    os.makedirs(example)
    for name in ("CMakeLists.txt", "custom_loop.cc"):
        shutil.copy(os.path.join(args.source_dir, "examples", name), example)
    build = os.path.join(example, "build")
    env = dict(os.environ)
    for var in ("CMAKE_PREFIX_PATH", "Tandem_DIR", "Tandem_ROOT", "CMAKE_BUILD_PARALLEL_LEVEL"):
        env.pop(var, None)
    configure = [args.cmake, "-S", example, "-B", build, f"-DCMAKE_PREFIX_PATH={prefix}",
                 f"-DCMAKE_CXX_COMPILER={args.cxx}", "-DCMAKE_BUILD_TYPE=Release",
                 "-DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON"]
    if args.generator:
        configure += ["-G", args.generator]
    if args.make_program:
        configure += [f"-DCMAKE_MAKE_PROGRAM={args.make_program}"]
    run(configure, timeout=120, env=env)
    cache = open(os.path.join(build, "CMakeCache.txt")).read()
    found = re.search(r"^Tandem_DIR:PATH=(.*)$", cache, re.M)
    if not found or not os.path.realpath(found.group(1)).startswith(os.path.realpath(prefix) + os.sep):
        raise Failure(f"find_package(Tandem) did not find the installed copy: Tandem_DIR is "
                      f"{found.group(1) if found else 'unset'}")
    run([args.cmake, "--build", build], timeout=240, env=env)
    binary = os.path.join(build, "tandem-example-custom-loop")
    if not os.access(binary, os.X_OK):
        raise Failure(f"{binary} was not built")
    return binary


def wait_for(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def run_example(binary, prefix, tmp):
    usage = run([binary, "--help"], timeout=30)
    if "Usage:" not in usage or "--train-steps" not in usage:
        raise Failure("--help printed no usage:\n" + usage)

    work = os.path.join(tmp, "run")
    os.makedirs(work)
    processes = []

    def start(name, argv):
        log = open(os.path.join(work, name + ".log"), "w")
        ready = os.path.join(work, name + ".ready.json")
        argv = argv + ["--name", name, "--listen-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0",
                       "--ready-file", ready]
        print("+ " + " ".join(argv), flush=True)
        processes.append((name, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=work)))
        if not wait_for(lambda: os.path.exists(ready) or processes[-1][1].poll() is not None, 30) or \
                not os.path.exists(ready):
            raise Failure(f"{name} did not start:\n" + read(os.path.join(work, name + ".log")))
        with open(ready) as f:
            return json.load(f)

    try:
        coordinator = start("coordinator", [os.path.join(prefix, "bin", "tandem-coordinator"), "--job-min-workers",
                                            "2", "--job-max-workers", "2", "--job-last-call-window", "0s"])
        for i in range(2):
            start(f"worker-{i}", [binary, "--coordinator-address", coordinator["grpc_address"], "--node-id",
                                  f"node-{i}", "--train-mode", "allreduce", "--train-steps", "20"])
        logs = [os.path.join(work, f"worker-{i}.log") for i in range(2)]
        if not wait_for(lambda: all("training finished" in read(log) for log in logs), 60):
            raise Failure("the example did not finish training:\n" + "\n".join(read(log) for log in logs))
        losses = {int(m.group(1)): float(m.group(2))
                  for log in logs for m in re.finditer(r"step (\d+): loss ([0-9.]+) \(2 workers\)", read(log))}
        if 10 not in losses or 20 not in losses or not losses[20] < losses[10]:
            raise Failure(f"rank 0's losses do not go down: {losses}\n" + "\n".join(read(log) for log in logs))
        print(f"the installed example trained: loss {losses[10]:.6f} at step 10, {losses[20]:.6f} at step 20")
    finally:
        for name, p in reversed(processes):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in reversed(processes):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", required=True)
    parser.add_argument("--source-dir", required=True)
    parser.add_argument("--cmake", default="cmake")
    parser.add_argument("--cxx", default="c++")
    parser.add_argument("--generator", default="")
    parser.add_argument("--make-program", default="")
    parser.add_argument("--keep", action="store_true", help="leave the temporary directory")
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="tandem-install-test-")
    try:
        prefix = os.path.join(tmp, "prefix")
        run([args.cmake, "--install", args.build_dir, "--prefix", prefix], timeout=120)
        check_layout(prefix)
        check_headers(args.cxx, prefix, tmp)
        binary = build_example(args, prefix, tmp)
        run_example(binary, prefix, tmp)
    except Failure as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
