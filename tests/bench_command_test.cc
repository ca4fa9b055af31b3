// The `tandem bench` commands that `make bench` runs, at small sizes: they
// finish, verify their own results (no wrong element), print the JSON keys
// docs/benchmarks.md and scripts/plot.py read, and name a bad flag.
// Timings are not checked here (they belong to `make bench`).
#include <filesystem>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "test_util.h"

namespace tandem {
namespace {

using testing::BinDir;
using testing::RunCommand;

// The JSON lines of `output` (progress goes to the same stream).
std::vector<std::string> JsonLines(const std::string& output) {
  std::vector<std::string> lines;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.front() == '{') lines.push_back(line);
  }
  return lines;
}

// The value of "key" in one JSON line: a number, null, or a quoted string
// (quotes kept); empty when the key is absent.
std::string Field(const std::string& line, const std::string& key) {
  const std::regex re("\"" + key + "\": (\"[^\"]*\"|[^,}]+)");
  std::smatch m;
  return std::regex_search(line, m, re) ? m[1].str() : "";
}

double Number(const std::string& line, const std::string& key) {
  const std::string v = Field(line, key);
  try {
    return std::stod(v);
  } catch (const std::exception&) {
    ADD_FAILURE() << key << " is not a number: '" << v << "' in " << line;
    return 0;
  }
}

// Runs `tandem` with space-separated `args`.
testing::CommandResult Tandem(const std::string& args, std::chrono::milliseconds timeout) {
  std::vector<std::string> argv = {BinDir() + "/tandem"};
  std::istringstream in(args);
  for (std::string word; in >> word;) argv.push_back(word);
  return RunCommand(argv, timeout);
}

bool HasUcxPerftest() {
  return RunCommand({"/bin/sh", "-c", "command -v ucx_perftest"}, std::chrono::seconds(10)).exit.success();
}

// Whether `tandem bench optimizer` will find torch: it tries python3, then
// /usr/bin/python3.
bool HasTorch() {
  return RunCommand({"/bin/sh", "-c",
                     "python3 -c 'import torch' 2>/dev/null || /usr/bin/python3 -c 'import torch' 2>/dev/null"},
                    std::chrono::seconds(60))
      .exit.success();
}

TEST(BenchCommandTest, PsPushesAndPullsExactlyAndReportsBothBaselines) {
  const auto r = Tandem(
      "bench ps --min-bytes 64KiB --max-bytes 16MiB --factor 16 --partition-bytes 4MiB --iters 3 --warmup 1 --rounds 1 "
      "--json --timeout 30s",
      std::chrono::seconds(100));
  ASSERT_TRUE(r.exit.success()) << r.output;
  const auto lines = JsonLines(r.output);
  ASSERT_EQ(lines.size(), 3u) << r.output;  // 64 KiB, 1 MiB, 16 MiB
  const bool perftest = HasUcxPerftest();
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& line = lines[i];
    SCOPED_TRACE(line);
    EXPECT_EQ(Field(line, "wrong"), "0");
    EXPECT_EQ(Number(line, "size_bytes"), static_cast<double>(64ULL << 10 << (4 * i)));
    for (const std::string key : {"push_gbps", "push_b2b_gbps", "pull_gbps", "step_gbps", "server_update_us"}) {
      EXPECT_GT(Number(line, key), 0) << key;
    }
    const bool one_message = i < 2;  // 16 MiB is four 4 MiB partitions
    EXPECT_EQ(Number(line, "partitions"), one_message ? 1 : 4);
    if (perftest) {
      EXPECT_GT(Number(line, "ucx_perftest_gbps"), 0);
      EXPECT_GT(Number(line, "push_ratio"), 0);
      EXPECT_GT(Number(line, "push_b2b_ratio"), 0);
      EXPECT_EQ(Field(line, "ucx_perftest_error"), "null");
      // The request/reply baseline is measured where a size is one message.
      if (one_message) {
        EXPECT_GT(Number(line, "ucx_perftest_rtt_gbps"), 0);
        EXPECT_GT(Number(line, "push_rtt_ratio"), 0);
        EXPECT_GT(Number(line, "pull_rtt_ratio"), 0);
      } else {
        EXPECT_EQ(Field(line, "ucx_perftest_rtt_gbps"), "null");
      }
    } else {
      // Without ucx-utils (make test does not install it) the baselines are
      // null and the reason says what to install.
      for (const std::string key :
           {"ucx_perftest_gbps", "push_ratio", "push_b2b_ratio", "ucx_perftest_rtt_gbps", "push_rtt_ratio"}) {
        EXPECT_EQ(Field(line, key), "null") << key;
      }
      EXPECT_NE(Field(line, "ucx_perftest_error").find("ucx-utils"), std::string::npos);
    }
  }
}

TEST(BenchCommandTest, PsWithoutTheBaselinePrintsATableThatNamesItsColumns) {
  const auto r = Tandem(
      "bench ps --min-bytes 64KiB --max-bytes 64KiB --dtype bf16 --optimizer adamw --iters 2 --warmup 1 --rounds 1 "
      "--no-baseline --timeout 30s",
      std::chrono::seconds(60));
  ASSERT_TRUE(r.exit.success()) << r.output;
  EXPECT_NE(r.output.find("ucx rtt"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("AdamW"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("# 0 wrong elements in total"), std::string::npos) << r.output;
}

TEST(BenchCommandTest, AllreduceChecksEveryResult) {
  const auto r =
      Tandem("bench allreduce --np 2 --min-bytes 8 --max-bytes 1MiB --factor 32 --iters 3 --warmup 1 --check --json",
             std::chrono::seconds(60));
  ASSERT_TRUE(r.exit.success()) << r.output;
  const auto lines = JsonLines(r.output);
  ASSERT_EQ(lines.size(), 4u) << r.output;  // 8 B, 256 B, 8 KiB and 256 KiB
  for (const std::string& line : lines) {
    SCOPED_TRACE(line);
    EXPECT_EQ(Field(line, "wrong"), "0");
    EXPECT_EQ(Field(line, "type"), "\"float32\"");
    EXPECT_EQ(Field(line, "redop"), "\"sum\"");
    EXPECT_GT(Number(line, "time_us"), 0);
    EXPECT_GE(Number(line, "algbw_gbps"), 0);  // rounded: a loaded host may print 0.0000
  }
}

// A stand-in for the torch baseline's interpreter: records the arguments
// the bench passes to bench/torch_optimizer.py and answers as that script
// does when torch is there (0.5 s median, 0.25 s best for every size).
std::string FakeTorchPython(const testing::TempDir& dir) {
  const std::string path = dir.File("python", R"(#!/bin/sh
echo "$@" > "$0.args"
while [ $# -gt 0 ]; do [ "$1" = --params ] && params=$2; shift; done
for n in $(echo "$params" | tr , ' '); do
  echo "{\"available\": true, \"torch_version\": \"0.fake\", \"params\": $n, \"seconds_per_step\": 0.5, \"best_seconds_per_step\": 0.25}"
done
)");
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  return path;
}

// Each update rule at two sizes (1000 is under one 16384-element chunk;
// 100003 is seven chunks over two threads, the last 1699 elements), with each
// way the torch baseline can go: the machine's own python3 (torch or not:
// make test does not install it), torch answering (a fake interpreter, so the
// joined columns are checked without torch), an interpreter that fails and
// --no-torch. Checked: the pooled update matches a single-threaded one bit
// for bit (wrong 0), each row reports the size asked for, and effective_gbps
// follows the documented byte model (28 B/param for Adam(W), 20 for SGD with
// momentum, 12 without) from the printed seconds_per_step. A missing torch is not an
// error: its fields are null and the output says why.
TEST(BenchCommandTest, OptimizerUpdatesExactlyWithOrWithoutTorch) {
  const bool torch = HasTorch();
  testing::TempDir dir;
  const std::string fake = FakeTorchPython(dir);
  struct Case {
    std::string optimizer;
    int bytes_per_param;
    std::string torch_flags;
    bool with_torch;
    std::string reason;  // why torch is unavailable, as the output says it
  };
  for (const Case& k : std::vector<Case>{{"adamw", 28, "", torch, ""},  // python3's own reason
                                         {"adam", 28, "--python " + fake, true, ""},
                                         {"sgd", 20, "--python /bin/false", false, "exited with status 1"},
                                         {"sgd", 12, "--momentum 0 --python " + fake, true, ""},  // plain SGD
                                         {"adamw", 28, "--no-torch", false, ""}}) {
    SCOPED_TRACE(k.optimizer + " " + k.torch_flags);
    const auto r = Tandem("bench optimizer --optimizer " + k.optimizer +
                              " --params 1000,100003 --threads 2 --iters 2 --warmup 1 --json " + k.torch_flags,
                          std::chrono::seconds(60));
    ASSERT_TRUE(r.exit.success()) << r.exit.ToString() << ": " << r.output;
    const auto lines = JsonLines(r.output);
    ASSERT_EQ(lines.size(), 2u) << r.output;
    if (k.torch_flags == "--no-torch") {
      EXPECT_EQ(r.output.find("torch baseline"), std::string::npos) << r.output;  // python never ran
    } else if (!k.with_torch) {
      EXPECT_NE(r.output.find("bench optimizer: torch unavailable: "), std::string::npos) << r.output;
      EXPECT_NE(r.output.find(k.reason), std::string::npos) << r.output;
    }
    if (k.torch_flags.find(fake) != std::string::npos) {
      // torch runs the same rule, sizes, threads and steps.
      const std::string args = testing::ReadFile(fake + ".args");
      EXPECT_NE(args.find("--optimizer " + k.optimizer + " --params 1000,100003 --threads 2 --iters 2 --warmup 1 "),
                std::string::npos)
          << args;
      if (k.optimizer == "sgd") {
        EXPECT_NE(args.find(k.bytes_per_param == 12 ? "--momentum 0 " : "--momentum 0.9 "), std::string::npos) << args;
      }
    }
    for (size_t i = 0; i < lines.size(); ++i) {
      const std::string& line = lines[i];
      SCOPED_TRACE(line);
      EXPECT_EQ(Field(line, "wrong"), "0");
      EXPECT_EQ(Field(line, "optimizer"), "\"" + k.optimizer + "\"");
      EXPECT_EQ(Field(line, "momentum"), k.optimizer != "sgd" ? "null" : k.bytes_per_param == 12 ? "0" : "0.9");
      const double params = i == 0 ? 1000 : 100003;
      EXPECT_EQ(Number(line, "params"), params);
      EXPECT_EQ(Number(line, "threads"), 2);
      EXPECT_EQ(Number(line, "bytes_per_param"), k.bytes_per_param);
      const double seconds = Number(line, "seconds_per_step");
      const double effective = Number(line, "effective_gbps");
      const double memory = Number(line, "memory_gbps");
      EXPECT_GT(seconds, 0);
      EXPECT_GT(Number(line, "best_seconds_per_step"), 0);
      EXPECT_LE(Number(line, "best_seconds_per_step"), seconds);
      EXPECT_GT(effective, 0);
      EXPECT_GT(memory, 0);
      // Printed with 6 and 5 significant digits: recomputed within 1e-4.
      EXPECT_NEAR(effective, k.bytes_per_param * params / seconds / 1e9, 1e-4 * effective);
      EXPECT_NEAR(Number(line, "bandwidth_ratio"), effective / memory, 1e-3 * effective / memory);
      if (k.torch_flags.find(fake) != std::string::npos) {
        EXPECT_EQ(Number(line, "torch_seconds_per_step"), 0.5);
        EXPECT_EQ(Number(line, "torch_best_seconds_per_step"), 0.25);
        EXPECT_EQ(Field(line, "torch_version"), "\"0.fake\"");
        EXPECT_NEAR(Number(line, "torch_speedup"), 0.5 / seconds, 1e-3 * 0.5 / seconds);
        EXPECT_EQ(Field(line, "torch_unavailable"), "null");
      } else if (k.with_torch) {
        EXPECT_GT(Number(line, "torch_seconds_per_step"), 0);
        EXPECT_GT(Number(line, "torch_speedup"), 0);
        EXPECT_NE(Field(line, "torch_version"), "null");
        EXPECT_EQ(Field(line, "torch_unavailable"), "null");
      } else {
        for (const std::string key :
             {"torch_seconds_per_step", "torch_best_seconds_per_step", "torch_speedup", "torch_version"}) {
          EXPECT_EQ(Field(line, key), "null") << key;
        }
        // Why, as the table says it.
        const std::string why = Field(line, "torch_unavailable");
        ASSERT_GT(why.size(), 2u) << why;
        EXPECT_EQ(why.front(), '"') << why;
        if (k.torch_flags == "--no-torch") {
          EXPECT_EQ(why, "\"skipped (--no-torch)\"");
        }
        if (!k.reason.empty()) {
          EXPECT_NE(why.find(k.reason), std::string::npos) << why;
        }
      }
    }
  }
}

// The table (what a person reads) names the byte model, says why the torch
// column is empty and sums the verification.
TEST(BenchCommandTest, OptimizerTableSaysWhyTorchIsMissing) {
  const auto r =
      Tandem("bench optimizer --params 1Ki --threads 1 --iters 1 --warmup 0 --no-torch", std::chrono::seconds(30));
  ASSERT_TRUE(r.exit.success()) << r.output;
  EXPECT_NE(r.output.find("# bytes per parameter: 28"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("# torch: unavailable (skipped (--no-torch))"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("#wrong"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("# 0 wrong elements in total"), std::string::npos) << r.output;
  EXPECT_TRUE(JsonLines(r.output).empty()) << r.output;
}

TEST(BenchCommandTest, ABadFlagIsNamedAndNothingRuns) {
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"bench ps --min-bytes 1KiB", "--min-bytes: 1KiB is out of range"},
           {"bench ps --dtype fp8", "--dtype"},
           {"bench ps --min-bytes 1MiB --max-bytes 64KiB", "--max-bytes"},
           {"bench allreduce --np 0", "--np"},
           {"bench model --batches 8,x", "--batches: 'x' is not a batch size"},
           {"bench model --batches ,", "--batches: name at least one batch size"},
           {"bench model --heads 3", "heads: must divide d_model"}}) {
    const auto r = Tandem(args, std::chrono::seconds(30));
    EXPECT_FALSE(r.exit.success()) << args << ": " << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << args << ": " << r.output;
  }
  // bench optimizer: a usage error is exit status 2 (3 is a wrong result) and
  // nothing is timed. 17179869185Gi is 2^30 once wrapped around 2^64: it must
  // be refused, not run as a 1Gi (28 GB) benchmark.
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"--params 0", "--params: 0 must be 1 to 2^32 parameters"},
           {"--momentum 0.5", "--momentum: applies to --optimizer sgd only (this is adamw)"},
           {"--params=-1", "--params: '-1' is not a count"},
           {"--params 1M,", "--params: empty item"},
           {"--params 5G", "--params: 5G must be 1 to 2^32 parameters"},
           {"--params 17179869185Gi", "--params: 17179869185Gi must be 1 to 2^32"},
           {"--optimizer lamb", "--optimizer: expected one of adamw|adam|sgd, got 'lamb'"},
           {"--iters 0", "--iters: 0 is out of range"},
           {"--threads 0", "--threads: 0 is out of range"},
           {"--warmup -1", "--warmup: -1 is out of range"}}) {
    const auto r = Tandem("bench optimizer --no-torch " + args, std::chrono::seconds(30));
    EXPECT_TRUE(r.exit.exited && r.exit.code == 2) << args << ": " << r.exit.ToString() << ": " << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << args << ": " << r.output;
    EXPECT_EQ(r.output.find("steps..."), std::string::npos) << args << ": " << r.output;  // no size started
  }
}

// Without a GPU (as in CI) the model bench says why it cannot run, naming the
// device; with one it runs (docs/benchmarks.md has the numbers of a lent GPU).
TEST(BenchCommandTest, ModelNamesTheGpuItCannotUse) {
  const auto r = Tandem("bench model --device 7 --batches 1 --torch=false", std::chrono::seconds(60));
  EXPECT_FALSE(r.exit.success()) << r.output;
  EXPECT_NE(r.output.find("model gpu: device 7"), std::string::npos) << r.output;
}

// bench torch is bench/torch_bench.py run by Python: --help names the script
// and where it is looked up, a bad flag is the script's exit status 2, and a
// Python that cannot run is named.
TEST(BenchCommandTest, TorchNamesItsScriptAndRefusesBadFlags) {
  const auto help = Tandem("bench torch --help", std::chrono::seconds(60));
  ASSERT_TRUE(help.exit.success()) << help.output;
  EXPECT_NE(help.output.find("bench/torch_bench.py --bin-dir " + BinDir()), std::string::npos) << help.output;
  EXPECT_NE(help.output.find("looked up in the source tree"), std::string::npos) << help.output;
  EXPECT_NE(help.output.find("--config"), std::string::npos) << help.output;  // the script's own help
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"--modes hybrid,nope", "'nope' is not one of hybrid, allreduce, ps"},
           {"--config huge", "huge"},
           {"--steps 1", "--steps at least 2"}}) {
    const auto r = Tandem("bench torch --dry-run " + args, std::chrono::seconds(60));
    EXPECT_TRUE(r.exit.exited && r.exit.code == 2) << args << ": " << r.exit.ToString() << ": " << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << args << ": " << r.output;
  }
  const auto dry = Tandem("bench torch --dry-run --config default --modes ps", std::chrono::seconds(60));
  ASSERT_TRUE(dry.exit.success()) << dry.output;
  EXPECT_NE(dry.output.find(BinDir() + "/tandem run --script "), std::string::npos) << dry.output;
  EXPECT_NE(dry.output.find("torch_ddp.py"), std::string::npos) << dry.output;
  const auto no_python = Tandem("bench torch --python /nonexistent/python3 --dry-run", std::chrono::seconds(30));
  EXPECT_TRUE(no_python.exit.exited && no_python.exit.code == 2) << no_python.output;
  EXPECT_NE(no_python.output.find("cannot run /nonexistent/python3"), std::string::npos) << no_python.output;
}

// One short round of both sides (a tiny model, 3 steps, allreduce mode) when
// /usr/bin/python3 has torch and the tandem package is built: the JSON row
// has the keys docs/benchmarks.md reads. Timings are not checked.
TEST(BenchCommandTest, TorchTrainsBothSidesAndPrintsTheRow) {
  if (!RunCommand({"/bin/sh", "-c", "/usr/bin/python3 -c 'import torch' 2>/dev/null"}, std::chrono::seconds(60))
           .exit.success() ||
      !std::filesystem::exists(BinDir() + "/../python/tandem")) {
    GTEST_SKIP() << "needs /usr/bin/python3 with torch and the tandem package (build/python/tandem)";
  }
  const auto r = Tandem(
      "bench torch --json --config default --rounds 1 --steps 3 --modes allreduce -- --d-model 32 --layers 1 "
      "--heads 2 --context 16",
      std::chrono::seconds(300));
  ASSERT_TRUE(r.exit.success()) << r.output;
  const auto lines = JsonLines(r.output);
  ASSERT_EQ(lines.size(), 1u) << r.output;
  const std::string& row = lines[0];
  EXPECT_EQ(Field(row, "config"), "\"default\"") << row;
  EXPECT_EQ(Field(row, "model"), "\"gpt\"") << row;
  EXPECT_EQ(Field(row, "mode"), "\"allreduce\"") << row;
  EXPECT_EQ(Number(row, "workers"), 4) << row;
  EXPECT_EQ(Number(row, "servers"), 0) << row;
  EXPECT_EQ(Number(row, "rounds"), 1) << row;
  EXPECT_GT(Number(row, "parameters"), 0) << row;
  EXPECT_GT(Number(row, "tandem_tokens_per_second"), 0) << row;
  EXPECT_GT(Number(row, "ddp_tokens_per_second"), 0) << row;
  EXPECT_GT(Number(row, "ratio"), 0) << row;
  const double exposed = Number(row, "exposed_comm_fraction");
  EXPECT_TRUE(exposed >= 0 && exposed <= 1) << row;
  EXPECT_NE(Field(row, "cpu"), "") << row;
  // Both sides trained the same samples from the same weights.
  EXPECT_NEAR(Number(row, "tandem_last_loss"), Number(row, "ddp_last_loss"), 1e-3) << row;
}

}  // namespace
}  // namespace tandem
