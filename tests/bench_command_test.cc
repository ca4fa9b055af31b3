// The `tandem bench` commands that `make bench` runs, at small sizes: they
// finish, verify their own results (no wrong element), print the JSON keys
// docs/benchmarks.md and scripts/plot.py read, and name a bad flag.
// Timings are not checked here (they belong to `make bench`).
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
}

// Without a GPU (as in CI) the model bench says why it cannot run, naming the
// device; with one it runs (docs/benchmarks.md has the numbers of a lent GPU).
TEST(BenchCommandTest, ModelNamesTheGpuItCannotUse) {
  const auto r = Tandem("bench model --device 7 --batches 1 --torch=false", std::chrono::seconds(60));
  EXPECT_FALSE(r.exit.success()) << r.output;
  EXPECT_NE(r.output.find("model gpu: device 7"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace tandem
