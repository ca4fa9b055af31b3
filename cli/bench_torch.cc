// tandem bench torch: a PyTorch model of examples/torch/ trained by Tandem
// (`tandem run --script`, in each mode) beside torch's own
// DistributedDataParallel (gloo), with the same processes, CPUs, global
// batch, steps and optimizer.
//
// The benchmark itself is bench/torch_bench.py (it needs torch); this command
// only runs it: PYTHON SCRIPT --bin-dir BIN_DIR FLAGS..., PYTHON being
// --python (default /usr/bin/python3) and SCRIPT the file in the source tree
// this binary was built from (TANDEM_SOURCE_DIR), BIN_DIR the directory of
// this binary (where `tandem run` is). Every other flag, and everything after
// "--", goes to the script unchanged; the script's exit status is the
// command's.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/launcher.h"

#ifndef TANDEM_SOURCE_DIR
#define TANDEM_SOURCE_DIR "."
#endif

namespace tandem::cli {

int BenchTorchCommand(int argc, char** argv) {
  const std::string script = std::string(TANDEM_SOURCE_DIR) + "/bench/torch_bench.py";
  std::string python = "/usr/bin/python3";
  std::vector<std::string> forwarded;
  bool help = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") {
      forwarded.insert(forwarded.end(), argv + i, argv + argc);
      break;
    }
    if (a == "--python") {
      if (i + 1 >= argc) {
        fmt::print(stderr, "tandem bench torch: --python needs a value (the interpreter whose torch imports)\n");
        return 2;
      }
      python = argv[++i];
      continue;
    }
    if (a.rfind("--python=", 0) == 0) {
      python = a.substr(9);
      continue;
    }
    if (a == "--help" || a == "-h") help = true;
    forwarded.push_back(a);
  }
  if (help) {
    fmt::print(
        "tandem bench torch: a PyTorch model trained by Tandem beside torch's DistributedDataParallel\n"
        "\n"
        "Runs PYTHON {} --bin-dir {} [flags] [-- EXAMPLE ARGS]\n"
        "  --python PATH   the interpreter (one whose torch imports; default /usr/bin/python3), now {}\n"
        "  the script is looked up in the source tree this binary was built from ({})\n"
        "\n"
        "The script's own help follows.\n\n",
        script, ExecutableDir(), python, TANDEM_SOURCE_DIR);
    std::fflush(stdout);
  }
  if (!std::filesystem::exists(script)) {
    fmt::print(stderr,
               "tandem bench torch: the benchmark script {} is missing (it is looked up in the source tree this "
               "binary was built from)\n",
               script);
    return 2;
  }
  std::vector<std::string> args = {python, script, "--bin-dir", ExecutableDir()};
  args.insert(args.end(), forwarded.begin(), forwarded.end());
  std::vector<char*> exec_argv;
  exec_argv.reserve(args.size() + 1);
  for (auto& a : args) exec_argv.push_back(a.data());
  exec_argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  ::execvp(python.c_str(), exec_argv.data());
  fmt::print(stderr, "tandem bench torch: cannot run {}: {} (name the Python with --python)\n", python,
             std::strerror(errno));
  return 2;
}

}  // namespace tandem::cli
