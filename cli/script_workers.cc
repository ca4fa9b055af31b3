#include "cli/script_workers.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "cli/launcher.h"
#include "common/json.h"

namespace tandem::cli {

SplitCommandLine SplitAtSeparator(const std::vector<std::string>& argv) {
  SplitCommandLine split;
  for (const auto& a : argv) {
    if (split.separator) {
      split.script.push_back(a);
    } else if (a == "--") {
      split.separator = true;
    } else {
      split.launcher.push_back(a);
    }
  }
  return split;
}

Status CheckScriptOptions(const ClusterOptions& o, const std::vector<std::string>& flags, bool separator) {
  if (o.script.file.empty()) {
    if (separator) {
      return InvalidArgument("the arguments after -- are a script's: give --script FILE.py (or leave them out)");
    }
    return Status::Ok();
  }
  constexpr char kDataParallel[] = "the PyTorch front end (--script) trains data-parallel only";
  if (o.tp > 1) return InvalidArgument("--tp {}: {}; tensor parallelism is the reference model's", o.tp, kDataParallel);
  if (o.pp > 1)
    return InvalidArgument("--pp {}: {}; pipeline parallelism is the reference model's", o.pp, kDataParallel);
  if (o.train.placement == "sharded") {
    return InvalidArgument("--placement sharded: {}, every worker keeping all of its parameters", kDataParallel);
  }
  const auto given = [&flags](std::string_view flag) {
    for (const std::string_view a : flags) {
      if (a.size() >= flag.size() + 2 && a.substr(0, 2) == "--" && a.substr(2, flag.size()) == flag &&
          (a.size() == flag.size() + 2 || a[flag.size() + 2] == '=')) {
        return true;
      }
    }
    return false;
  };
  const worker::TrainConfig d;
  const std::pair<std::string_view, bool> model_options[] = {
      {"train-context", o.train.context != d.context},
      {"train-d-model", o.train.d_model != d.d_model},
      {"train-heads", o.train.heads != d.heads},
      {"train-layers", o.train.layers != d.layers},
      {"train-activation-checkpointing", o.train.activation_checkpointing != d.activation_checkpointing},
  };
  for (const auto& [flag, changed] : model_options) {
    if (changed || given(flag)) {
      return InvalidArgument("--{}: an option of the reference model; with --script the script builds its own model",
                             flag);
    }
  }
  if (o.train.pipeline_schedule != d.pipeline_schedule || given("train-pipeline-schedule")) {
    return InvalidArgument("--train-pipeline-schedule: {}; pipeline parallelism is the reference model's",
                           kDataParallel);
  }
  return Status::Ok();
}

Status CheckScriptFiles(const ScriptOptions& script) {
  if (access(script.file.c_str(), R_OK) != 0) {
    return InvalidArgument("--script: cannot read '{}': {}", script.file, std::strerror(errno));
  }
  // /usr/bin/env would read NAME=VALUE as a variable, not a program.
  if (script.python.empty() || script.python.find('=') != std::string::npos) {
    return InvalidArgument("--python: '{}' is not a program that can be run (a path without '=')", script.python);
  }
  // A bare name is looked up on PATH by env.
  if (script.python.find('/') != std::string::npos && access(script.python.c_str(), X_OK) != 0) {
    return InvalidArgument("--python: cannot run '{}': {}", script.python, std::strerror(errno));
  }
  return Status::Ok();
}

std::string FlagsJson(const std::vector<std::string>& flags) {
  std::string out = "[";
  for (size_t i = 0; i < flags.size(); ++i) out += (i ? "," : "") + JsonQuote(flags[i]);
  return out + "]";
}

std::string ScriptPythonPath(const std::string& bin_dir, const char* existing) {
  std::error_code ec;
  std::filesystem::path bin = std::filesystem::absolute(bin_dir, ec);
  if (ec) bin = bin_dir;
  std::string path = (bin / ".." / "python").lexically_normal().string();
  // "build/bin/" normalises to "build/python/": no trailing slash.
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  if (existing != nullptr && *existing != '\0') path += std::string(":") + existing;
  return path;
}

std::vector<std::string> ScriptCommand(const ScriptOptions& script, const std::string& bin_dir,
                                       const std::vector<std::string>& flags, const std::string& describe_file) {
  std::error_code ec;
  const std::filesystem::path file = std::filesystem::absolute(script.file, ec);
  std::vector<std::string> argv = {
      "/usr/bin/env",       "-u",
      "TANDEM_DESCRIBE",    "PYTHONPATH=" + ScriptPythonPath(bin_dir, std::getenv("PYTHONPATH")),
      "PYTHONUNBUFFERED=1", "TANDEM_WORKER_FLAGS=" + FlagsJson(flags)};
  if (!describe_file.empty()) argv.push_back("TANDEM_DESCRIBE=" + describe_file);
  argv.insert(argv.end(), {script.python, "-u", ec ? script.file : file.string()});
  argv.insert(argv.end(), script.args.begin(), script.args.end());
  return argv;
}

namespace {

// "; the end of LOG:\n    | ..." for an error message, or that the log is empty.
std::string EndOfLog(const std::string& log, const LogTail& tail) {
  if (tail.text.empty()) return fmt::format("; it printed nothing ({} is empty)", log);
  return fmt::format("; the end of {}:\n{}", log, tail.text);
}

}  // namespace

Result<ScriptModel> DescribeScript(const ScriptOptions& script, const std::string& bin_dir,
                                   const std::vector<std::string>& flags, const std::string& work_dir,
                                   ShutdownSignal& shutdown) {
  using std::chrono::milliseconds;
  const std::string out = work_dir + "/describe.json";
  const std::string log = work_dir + "/describe.log";
  std::remove(out.c_str());
  std::remove(log.c_str());
  SpawnOptions options;
  options.argv = ScriptCommand(script, bin_dir, flags, out);
  options.output_file = log;
  TANDEM_ASSIGN_OR_RETURN(auto process, Subprocess::Spawn(options));
  const auto deadline = std::chrono::steady_clock::now() + script.describe_timeout;
  ExitInfo exit;
  while (true) {
    if (auto e = process->Wait(milliseconds(50)); e.ok()) {
      exit = *e;
      break;
    }
    if (shutdown.requested()) {
      (void)process->Stop(milliseconds(2000));
      return Cancelled("interrupted while the script described its model");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      (void)process->Stop(milliseconds(2000));
      return DeadlineExceeded(
          "--script {}: in describe mode, the script did not create a tandem.torch.DistributedOptimizer within {} s "
          "(--describe-timeout){}",
          script.file, script.describe_timeout.count() / 1000.0, EndOfLog(log, TailOfLog(log, 15)));
    }
  }
  if (!exit.success()) {
    const LogTail tail = TailOfLog(log, 15);
    return FailedPrecondition(
        "--script {}: in describe mode, the script {} before it created a tandem.torch.DistributedOptimizer{}{}",
        script.file, DescribeExit(exit), tail.exception.empty() ? "" : ": " + tail.exception, EndOfLog(log, tail));
  }
  if (access(out.c_str(), R_OK) != 0) {
    return FailedPrecondition(
        "--script {}: in describe mode, the script exited with status 0 but did not create a "
        "tandem.torch.DistributedOptimizer (which writes {} and ends the process){}",
        script.file, out, EndOfLog(log, TailOfLog(log, 15)));
  }
  ScriptModel model;
  try {
    const YAML::Node n = YAML::LoadFile(out);  // JSON, which YAML reads
    model.parameters = n["parameters"].as<uint64_t>();
    if (n["tensors"]) model.tensors = n["tensors"].as<uint64_t>();
  } catch (const YAML::Exception& e) {
    return InvalidArgument("--script {}: the model's description {} is not valid: {}", script.file, out, e.what());
  }
  if (model.parameters == 0) {
    return InvalidArgument("--script {}: the model's description {} counts no parameters", script.file, out);
  }
  return model;
}

}  // namespace tandem::cli
