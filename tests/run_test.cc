// `tandem run` (what `make demo` runs): a whole local cluster trains and goes
// down cleanly, on its own or on Ctrl-C; bad flags and missing binaries are
// reported. --script: the command line's split at --, the refused options,
// the flags and environment a script worker gets, how its log is quoted.
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <functional>

#include <gtest/gtest.h>

#include "cli/launcher.h"
#include "cli/script_workers.h"
#include "common/cpus.h"
#include "common/process.h"
#include "test_util.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;
using testing::BinDir;
using testing::RunCommand;

const std::vector<std::string> kSmallModel = {"--train-layers",       "1", "--train-d-model", "32",
                                              "--train-heads",        "2", "--train-context", "16",
                                              "--train-global-batch", "4"};

TEST(TandemRunTest, TrainsOnALocalClusterAndStopsItCleanly) {
  testing::TempDir dir;
  std::vector<std::string> argv = {BinDir() + "/tandem", "run",      "--nodes",   "2",
                                   "--servers",          "2",        "--steps",   "8",
                                   "--work-dir",         dir.path(), "--summary", dir.path() + "/summary.json"};
  argv.insert(argv.end(), kSmallModel.begin(), kSmallModel.end());
  const auto r = RunCommand(argv, std::chrono::seconds(90));
  ASSERT_TRUE(r.exit.success()) << r.output;
  EXPECT_NE(r.output.find("step 8/8"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Done: 8 of 8 steps"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the servers applied 8 updates (one per completed step)"), std::string::npos) << r.output;
  for (const std::string name : {"coordinator", "server-0", "server-1", "worker-0", "worker-1"}) {
    const std::string log = testing::ReadFile(dir.path() + "/" + name + ".log");
    EXPECT_NE(log.find("stopped cleanly"), std::string::npos) << name << ":\n" << log;
  }
  // --bind (the default): each worker on its own share of the CPUs.
  for (int i = 0; i < 2; ++i) {
    const std::string log = testing::ReadFile(dir.path() + "/worker-" + std::to_string(i) + ".log");
    const std::string cpus = FormatCpuList(ShareOfCpus(AllowedCpus(), i, 2));
    EXPECT_NE(log.find("running on CPUs " + cpus + "\n"), std::string::npos) << "worker-" << i << ":\n" << log;
  }
  const std::string summary = testing::ReadFile(dir.path() + "/summary.json");
  for (const std::string key : {"steps", "first_loss", "last_loss", "tokens_per_second", "mode", "world_size", "epochs",
                                "faults", "server_steps_applied"}) {
    EXPECT_NE(summary.find("\"" + key + "\":"), std::string::npos) << key << "\n" << summary;
  }
}

// Servers that refuse the first InitializeParameters calls with UNAVAILABLE
// (as one whose gRPC channel is still connecting on a loaded host does): the
// workers retry within the epoch instead of waiting for an epoch that never
// comes, and training completes.
TEST(TandemRunTest, WorkersRetryServersThatAreNotReadyToInitialiseYet) {
  testing::TempDir dir;
  std::vector<std::string> argv = {"/usr/bin/env",
                                   "TANDEM_FAILPOINTS=ps.initialize_unavailable=3",
                                   BinDir() + "/tandem",
                                   "run",
                                   "--nodes",
                                   "2",
                                   "--servers",
                                   "2",
                                   "--steps",
                                   "4",
                                   "--work-dir",
                                   dir.path(),
                                   "--bind=false"};
  argv.insert(argv.end(), kSmallModel.begin(), kSmallModel.end());
  const auto r = RunCommand(argv, std::chrono::seconds(90));
  ASSERT_TRUE(r.exit.success()) << r.output;
  EXPECT_NE(r.output.find("Done: 4 of 4 steps"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("membership epochs 1,"), std::string::npos) << r.output;
  std::string logs;
  for (int i = 0; i < 2; ++i) logs += testing::ReadFile(dir.path() + "/worker-" + std::to_string(i) + ".log");
  EXPECT_NE(logs.find("failpoint ps.initialize_unavailable"), std::string::npos) << logs;
  EXPECT_NE(logs.find("; retrying in 100 ms"), std::string::npos) << logs;
  EXPECT_EQ(logs.find("waiting for the next epoch"), std::string::npos) << logs;
}

TEST(TandemRunTest, CtrlCStopsAHeldCluster) {
  testing::TempDir dir;
  SpawnOptions options;
  options.argv = {BinDir() + "/tandem", "run",      "--servers",   "1", "--nodes", "1", "--steps", "2", "--hold",
                  "--work-dir",         dir.path(), "--bind=false"};
  options.argv.insert(options.argv.end(), kSmallModel.begin(), kSmallModel.end());
  options.output_file = dir.path() + "/run.out";
  auto run = Subprocess::Spawn(options);
  ASSERT_TRUE(run.ok());
  bool holding = false;
  for (int i = 0; i < 1200 && !holding; ++i) {
    holding = testing::ReadFile(options.output_file).find("holding the cluster up") != std::string::npos;
    if (!holding) std::this_thread::sleep_for(milliseconds(50));
  }
  ASSERT_TRUE(holding) << testing::ReadFile(options.output_file);
  ASSERT_TRUE((*run)->Signal(SIGINT).ok());
  auto exit = (*run)->Wait(milliseconds(20000));
  ASSERT_TRUE(exit.ok()) << testing::ReadFile(options.output_file);
  EXPECT_TRUE(exit->success()) << testing::ReadFile(options.output_file);
  EXPECT_NE(testing::ReadFile(options.output_file).find("Done: 2 of 2 steps"), std::string::npos);
  // --bind=false: the worker runs wherever the scheduler puts it.
  EXPECT_EQ(testing::ReadFile(dir.path() + "/worker-0.log").find("running on CPUs"), std::string::npos);
}

TEST(TandemRunTest, AMissingBinaryIsReportedAndNothingIsLeftRunning) {
  testing::TempDir dir;
  const auto r = RunCommand({BinDir() + "/tandem", "run", "--bin-dir", dir.path(), "--work-dir", dir.path()});
  EXPECT_EQ(r.exit.ToString(), "exit 1") << r.output;
  EXPECT_NE(r.output.find("cannot run '" + dir.path() + "/tandem-coordinator'"), std::string::npos) << r.output;
}

TEST(TandemRunTest, BadFlagsExitWithStatus2) {
  const auto r = RunCommand({BinDir() + "/tandem", "run", "--servers", "-1"});
  EXPECT_EQ(r.exit.ToString(), "exit 2");
  EXPECT_NE(r.output.find("--servers: -1 is out of range: accepted 0..64"), std::string::npos) << r.output;
  // A membership change is asked for after a step that is done: not after the last.
  for (const std::string flag : {"--kill-worker-at", "--add-worker-at"}) {
    const auto late = RunCommand({BinDir() + "/tandem", "run", "--steps", "10", flag, "10"});
    EXPECT_EQ(late.exit.ToString(), "exit 2") << late.output;
    EXPECT_NE(late.output.find(flag + ": 10 must be below --steps (10)"), std::string::npos) << late.output;
  }
  const auto unknown = RunCommand({BinDir() + "/tandem", "frobnicate"});
  EXPECT_EQ(unknown.exit.ToString(), "exit 2");
  EXPECT_NE(unknown.output.find("unknown command 'frobnicate'"), std::string::npos);
}

// --script FILE.py [flags] -- ARGS: the script's arguments are everything
// after the first "--", another "--" included, and tandem run parses none.
TEST(TandemRunScriptTest, TheCommandLineSplitsAtTheFirstSeparator) {
  const auto split = cli::SplitAtSeparator(
      {"tandem", "run", "--script", "train.py", "--steps", "5", "--", "--lr", "0.1", "--", "--help"});
  EXPECT_TRUE(split.separator);
  EXPECT_EQ(split.launcher, (std::vector<std::string>{"tandem", "run", "--script", "train.py", "--steps", "5"}));
  EXPECT_EQ(split.script, (std::vector<std::string>{"--lr", "0.1", "--", "--help"}));
  const auto none = cli::SplitAtSeparator({"tandem", "run", "--steps", "5"});
  EXPECT_FALSE(none.separator);
  EXPECT_TRUE(none.script.empty());
  const auto empty = cli::SplitAtSeparator({"tandem", "run", "--script", "train.py", "--"});
  EXPECT_TRUE(empty.separator);
  EXPECT_TRUE(empty.script.empty());
  EXPECT_EQ(empty.launcher.size(), 4u);
}

TEST(TandemRunScriptTest, TheReferenceModelsOptionsAreRefusedByName) {
  const auto check = [](const std::function<void(cli::ClusterOptions&)>& set, const std::vector<std::string>& flags) {
    cli::ClusterOptions o;
    o.script.file = "train.py";
    set(o);
    return cli::CheckScriptOptions(o, flags, false);
  };
  const auto nothing = [](cli::ClusterOptions&) {};
  EXPECT_TRUE(check(nothing, {"--script", "train.py", "--nodes", "2", "--mode", "ps", "--train-lr", "0.1"}).ok());
  EXPECT_TRUE(check([](cli::ClusterOptions& o) { o.tp = 1; }, {"--tp", "1"}).ok());  // 1 is no split
  const std::vector<std::pair<std::function<void(cli::ClusterOptions&)>, std::string>> refused = {
      {[](cli::ClusterOptions& o) { o.tp = 2; }, "--tp 2: "},
      {[](cli::ClusterOptions& o) { o.pp = 4; }, "--pp 4: "},
      {[](cli::ClusterOptions& o) { o.train.placement = "sharded"; }, "--placement sharded: "},
      {[](cli::ClusterOptions& o) { o.train.layers = 2; }, "--train-layers: "},  // e.g. from a --config file
      {[](cli::ClusterOptions& o) { o.train.d_model = 64; }, "--train-d-model: "},
      {[](cli::ClusterOptions& o) { o.train.activation_checkpointing = true; }, "--train-activation-checkpointing: "},
      {[](cli::ClusterOptions& o) { o.train.pipeline_schedule = "gpipe"; }, "--train-pipeline-schedule: "},
  };
  for (const auto& [set, message] : refused) {
    const Status s = check(set, {});
    EXPECT_FALSE(s.ok()) << message;
    EXPECT_EQ(s.message().rfind(message, 0), 0u) << s.message();
  }
  // Given at its default value still names it: the script would ignore it.
  for (const std::string flag : {"--train-context", "--train-heads=4", "--train-layers"}) {
    const Status s = check(nothing, {"--script", "train.py", flag, "4"});
    EXPECT_NE(s.message().find(flag.substr(0, flag.find('=')) + ": an option of the reference model"),
              std::string::npos)
        << flag << ": " << s.message();
  }
  // A flag that merely starts like one is not taken for it.
  EXPECT_TRUE(check(nothing, {"--train-layersx"}).ok());
  // Without --script, arguments after -- have nowhere to go.
  cli::ClusterOptions plain;
  EXPECT_NE(cli::CheckScriptOptions(plain, {}, true).message().find("give --script FILE.py"), std::string::npos);
  EXPECT_TRUE(cli::CheckScriptOptions(plain, {}, false).ok());
}

// The flags a tandem-worker would get travel as a JSON array of strings, and
// the script runs under env with the package's directory first on PYTHONPATH.
TEST(TandemRunScriptTest, AScriptWorkerGetsItsFlagsAndEnvironment) {
  EXPECT_EQ(cli::FlagsJson({}), "[]");
  EXPECT_EQ(cli::FlagsJson({"--name", "worker-0", "--train-data", "/data/a \"b\"\\c.txt", "tab\there"}),
            R"(["--name","worker-0","--train-data","/data/a \"b\"\\c.txt","tab\u0009here"])");
  EXPECT_EQ(cli::ScriptPythonPath("/opt/tandem/build/bin", nullptr), "/opt/tandem/build/python");
  EXPECT_EQ(cli::ScriptPythonPath("/opt/tandem/build/bin/", ""), "/opt/tandem/build/python");
  EXPECT_EQ(cli::ScriptPythonPath("/opt/tandem/build/bin", "/site:/more"), "/opt/tandem/build/python:/site:/more");
  EXPECT_EQ(cli::ScriptPythonPath("build/bin", nullptr),
            (std::filesystem::current_path() / "build" / "python").string());

  cli::ScriptOptions script;
  script.file = "/work/train.py";
  script.python = "/opt/py/bin/python3";
  script.args = {"--epochs", "3", "--"};
  const std::vector<std::string> flags = {"--name", "worker-1", "--train-steps", "5"};
  const auto argv = cli::ScriptCommand(script, "/opt/tandem/build/bin", flags);
  const std::string pythonpath = std::getenv("PYTHONPATH") ? std::string(":") + std::getenv("PYTHONPATH") : "";
  EXPECT_EQ(argv, (std::vector<std::string>{"/usr/bin/env", "-u", "TANDEM_DESCRIBE",
                                            "PYTHONPATH=/opt/tandem/build/python" + pythonpath, "PYTHONUNBUFFERED=1",
                                            R"(TANDEM_WORKER_FLAGS=["--name","worker-1","--train-steps","5"])",
                                            "/opt/py/bin/python3", "-u", "/work/train.py", "--epochs", "3", "--"}));
  const auto describe = cli::ScriptCommand(script, "/opt/tandem/build/bin", flags, "/tmp/w/describe.json");
  EXPECT_NE(std::find(describe.begin(), describe.end(), "TANDEM_DESCRIBE=/tmp/w/describe.json"), describe.end());
  EXPECT_EQ(describe.size(), argv.size() + 1);
}

// A Python traceback in a process's log is what an error message quotes,
// however much the process logged after it; without one, the last lines.
TEST(TandemRunScriptTest, TheLogTailQuotesTheLastTraceback) {
  testing::TempDir dir;
  std::string log = "[info] epoch 1: rank 1 of 2\nTraceback (most recent call last):\n  File \"old.py\"\nKeyError: 1\n";
  log += "Traceback (most recent call last):\n";
  for (int i = 0; i < 60; ++i) log += "  File \"train.py\", line " + std::to_string(i) + ", in f\n    f()\n";
  log += "ValueError: the batch has the wrong shape\n";
  for (int i = 0; i < 30; ++i) log += "[info] shutting down " + std::to_string(i) + "\n";
  const cli::LogTail tail = cli::TailOfLog(dir.File("worker.log", log), 15);
  EXPECT_EQ(tail.exception, "ValueError: the batch has the wrong shape");
  EXPECT_EQ(tail.text.rfind("    | Traceback (most recent call last):\n    | ...\n", 0), 0u) << tail.text;
  EXPECT_NE(tail.text.find("line 59, in f\n"), std::string::npos) << tail.text;  // the innermost frame
  EXPECT_NE(tail.text.find("    | ValueError: the batch has the wrong shape\n"), std::string::npos);
  EXPECT_EQ(tail.text.find("KeyError"), std::string::npos) << tail.text;  // an earlier traceback
  EXPECT_EQ(tail.text.find("shutting down 10"), std::string::npos) << tail.text;

  const cli::LogTail plain = cli::TailOfLog(dir.File("plain.log", "a\nb\nc\n"), 2);
  EXPECT_EQ(plain.text, "    | b\n    | c\n");
  EXPECT_TRUE(plain.exception.empty());
  EXPECT_TRUE(cli::TailOfLog(dir.path() + "/missing.log", 5).text.empty());
}

TEST(TandemRunScriptTest, TheCommandRefusesWhatAScriptCannotDoAndDocumentsIt) {
  testing::TempDir dir;
  const std::string script = dir.File("train.py", "raise SystemExit(3)\n");
  const auto tp = RunCommand({BinDir() + "/tandem", "run", "--script", script, "--tp", "2", "--", "--help"});
  EXPECT_EQ(tp.exit.ToString(), "exit 2") << tp.output;
  EXPECT_NE(tp.output.find("tandem run: --tp 2: the PyTorch front end (--script) trains data-parallel only"),
            std::string::npos)
      << tp.output;
  const auto stray = RunCommand({BinDir() + "/tandem", "run", "--steps", "5", "--", "--lr", "1"});
  EXPECT_EQ(stray.exit.ToString(), "exit 2") << stray.output;
  EXPECT_NE(stray.output.find("the arguments after -- are a script's"), std::string::npos) << stray.output;
  const auto missing = RunCommand({BinDir() + "/tandem", "run", "--script", dir.path() + "/nope.py"});
  EXPECT_EQ(missing.exit.ToString(), "exit 1") << missing.output;
  EXPECT_NE(missing.output.find("--script: cannot read '" + dir.path() + "/nope.py'"), std::string::npos)
      << missing.output;
  // A script that ends before describing its model: its status and log are named, nothing else starts.
  const auto early = RunCommand({BinDir() + "/tandem", "run", "--script", script, "--work-dir", dir.path()});
  EXPECT_EQ(early.exit.ToString(), "exit 1") << early.output;
  EXPECT_NE(early.output.find("in describe mode, the script exited with status 3 before it created a "
                              "tandem.torch.DistributedOptimizer"),
            std::string::npos)
      << early.output;
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/coordinator.log"));
  const auto help = RunCommand({BinDir() + "/tandem", "run", "--help"});
  EXPECT_TRUE(help.exit.success());
  for (const std::string text : {"--script TEXT", "--python TEXT", "--script FILE.py [flags] [-- ARGS...]"}) {
    EXPECT_NE(help.output.find(text), std::string::npos) << text << "\n" << help.output;
  }
}

}  // namespace
}  // namespace tandem
