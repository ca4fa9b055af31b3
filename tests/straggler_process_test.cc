// The straggler score end to end: a coordinator, a parameter server and two
// nodes of two workers training in hybrid mode, once as they are and once
// with one worker slowed on purpose (failpoint train.step_delay_ms) from
// step 12 on, so that the job's steps take about 1.5 times as long. The
// slowed worker is named by rank and node within 20 steps in the
// coordinator's log, `tandem status --json`, the metric, and the shipped
// alert's expression (promtool, when installed); in the run without one, no
// one is named anywhere.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include "cli/launcher.h"
#include "common/health.h"
#include "launch_util.h"
#include "test_util.h"

namespace tandem {
namespace {

using testing::BinDir;
using testing::ReadFile;
using testing::RunCommand;

constexpr int kSteps = 40;
constexpr uint64_t kSlowFrom = 12;
// A smaller model than the demo's (its steps are shorter): 136,960 parameters.
const std::vector<std::string> kModel = {"--train-layers", "2", "--train-d-model", "64"};

struct Outcome {
  std::string failure;               // empty when every step completed
  std::vector<double> step_seconds;  // from rank 0's progress file, by step
  std::string coordinator_log;
  std::string status_json;              // `tandem status --json` once training ended
  std::string metrics;                  // the coordinator's page then
  uint64_t first_named_step = 0;        // the job's step when `tandem status` first showed someone named
  std::vector<std::string> named_seen;  // "rank R on NODE" of everyone it showed named while training
};

// One run; `failpoint` goes to worker-3 (rank 3, node-1).
Outcome Train(const testing::TempDir& dir, const std::string& name, const std::string& failpoint) {
  Outcome out;
  const std::string work = dir.path() + "/" + name;
  std::filesystem::create_directories(work);
  std::vector<cli::LaunchedDaemon> daemons;
  const auto launch = [&](const std::string& binary, const std::string& instance, std::vector<std::string> args,
                          std::vector<std::string> prefix = {}) {
    auto d = testing::StartDaemon(binary, instance, work, std::move(args), std::move(prefix));
    if (!d.ok()) {
      out.failure = instance + ": " + d.status().ToString();
      return false;
    }
    daemons.push_back(std::move(*d));
    return true;
  };
  const auto stop = [&] {
    for (size_t i = daemons.size(); i-- > 0;) (void)daemons[i].process->Signal(SIGTERM);
    for (size_t i = daemons.size(); i-- > 0;) {
      if (!daemons[i].process->Wait(std::chrono::milliseconds(10000)).ok())
        (void)daemons[i].process->Stop(std::chrono::milliseconds(0));
    }
    if (!daemons.empty()) out.coordinator_log = ReadFile(daemons[0].log_file);
  };
  if (!launch("tandem-coordinator", "coordinator",
              {"--job-min-workers", "4", "--job-max-workers", "4", "--job-min-servers", "1", "--job-last-call-window",
               "0s", "--job-parameter-count", "136960", "--job-partition-size", "16KiB", "--job-heartbeat-interval",
               "200ms", "--job-heartbeat-deadline", "5s"})) {
    stop();
    return out;
  }
  const std::string coordinator = daemons[0].ready.grpc_address;
  if (!launch("tandem-server", "server-0", {"--coordinator-address", coordinator, "--node-id", "node-s"})) {
    stop();
    return out;
  }
  const std::string progress = work + "/progress.jsonl";
  for (int i = 0; i < 4; ++i) {
    std::vector<std::string> prefix;
    if (i == 3 && !failpoint.empty()) prefix = {"/usr/bin/env", "TANDEM_FAILPOINTS=" + failpoint};
    std::vector<std::string> args = {"--coordinator-address",         coordinator,     "--node-id",
                                     "node-" + std::to_string(i / 2), "--train-steps", std::to_string(kSteps),
                                     "--train-progress-file",         progress};
    args.insert(args.end(), kModel.begin(), kModel.end());
    if (!launch("tandem-worker", "worker-" + std::to_string(i), std::move(args), prefix)) {
      stop();
      return out;
    }
  }
  // While it trains: who `tandem status` names, and from which step.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(100);
  const auto status = [&] {
    return RunCommand({BinDir() + "/tandem", "status", "--coordinator", coordinator, "--json"},
                      std::chrono::seconds(10))
        .output;
  };
  while (ReadFile(progress).find("\"finished\"") == std::string::npos) {
    if (std::chrono::steady_clock::now() > deadline) {
      out.failure = "training did not finish within 100 s";
      break;
    }
    try {
      const YAML::Node s = YAML::Load(status());
      for (const auto& m : s["members"]) {
        if (!m["straggler"] || !m["straggler"]["named"] || !m["straggler"]["named"].as<bool>()) continue;
        const std::string who =
            "rank " + m["rank"]["global_rank"].as<std::string>("0") + " on " + m["node"]["node_id"].as<std::string>();
        if (std::find(out.named_seen.begin(), out.named_seen.end(), who) == out.named_seen.end())
          out.named_seen.push_back(who);
        if (out.first_named_step == 0) out.first_named_step = m["straggler"]["named_at_step"].as<uint64_t>();
      }
    } catch (const std::exception&) {
      // The coordinator is starting or stopping.
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  out.status_json = status();
  auto page = HttpGet(daemons[0].ready.metrics_address, "/metrics", std::chrono::milliseconds(5000));
  out.metrics = page.ok() ? *page : page.status().ToString();
  std::istringstream lines(ReadFile(progress));
  for (std::string line; std::getline(lines, line);) {
    const YAML::Node r = YAML::Load(line);
    if (r["step_seconds"]) out.step_seconds.push_back(r["step_seconds"].as<double>());
  }
  stop();
  return out;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// The value of `metric` with exactly these labels on a Prometheus page; -1 if absent.
double Sample(const std::string& page, const std::string& metric, const std::string& rank) {
  const std::regex line("^" + metric + R"(\{([^}]*)\} ([0-9.eE+-]+)$)");
  std::istringstream in(page);
  for (std::string l; std::getline(in, l);) {
    std::smatch m;
    if (std::regex_match(l, m, line) && m[1].str().find("rank=\"" + rank + "\"") != std::string::npos)
      return std::stod(m[2].str());
  }
  return -1;
}

// Evaluates the expression (and `for:`) of the shipped TandemStraggler alert
// with promtool over the coordinator's scraped tandem_coordinator_straggler
// series, held for 10 minutes: "ok" when it fires for exactly `expected`
// (rank, node), promtool's complaint otherwise, or "skipped" without promtool.
std::string CheckAlert(const testing::TempDir& dir, const std::string& page,
                       const std::vector<std::pair<std::string, std::string>>& expected) {
  if (access("/usr/bin/promtool", X_OK) != 0) return "skipped";
  std::string expr, hold;
  const YAML::Node file = YAML::LoadFile(testing::SourceDir() + "/deploy/prometheus/rules/tandem-alerts.yaml");
  for (const YAML::Node& group : file["groups"]) {
    for (const YAML::Node& r : group["rules"]) {
      if (!r["alert"] || r["alert"].as<std::string>() != "TandemStraggler") continue;
      expr = r["expr"].as<std::string>();
      hold = r["for"].as<std::string>();
    }
  }
  if (expr.empty()) return "no TandemStraggler alert in deploy/prometheus/rules/tandem-alerts.yaml";
  YAML::Emitter rules;
  rules << YAML::BeginMap << YAML::Key << "groups" << YAML::Value << YAML::BeginSeq << YAML::BeginMap << YAML::Key
        << "name" << YAML::Value << "straggler" << YAML::Key << "rules" << YAML::Value << YAML::BeginSeq
        << YAML::BeginMap << YAML::Key << "alert" << YAML::Value << "TandemStraggler" << YAML::Key << "expr"
        << YAML::Value << expr << YAML::Key << "for" << YAML::Value << hold << YAML::EndMap << YAML::EndSeq
        << YAML::EndMap << YAML::EndSeq << YAML::EndMap;
  std::ofstream(dir.path() + "/straggler_rules.yaml") << rules.c_str() << "\n";
  const std::regex line(R"(^tandem_coordinator_straggler\{([^}]*)\} ([0-9.eE+-]+)$)");
  std::string series;
  std::istringstream in(page);
  for (std::string l; std::getline(in, l);) {
    std::smatch m;
    if (!std::regex_match(l, m, line)) continue;
    series += "      - series: 'tandem_coordinator_straggler{job=\"tandem-coordinator\", instance=\"c:9400\", " +
              m[1].str() + "}'\n        values: '" + m[2].str() + "x20'\n";
  }
  if (series.empty()) return "no tandem_coordinator_straggler series on the page";
  std::string alerts;
  for (const auto& [rank, node] : expected) {
    alerts +=
        "          - exp_labels: {job: tandem-coordinator, instance: \"c:9400\", job_id: default, node_id: " + node +
        ", rank: \"" + rank + "\"}\n";
  }
  const std::string tests = dir.path() + "/straggler_alert_test.yaml";
  std::ofstream(tests) << "rule_files:\n  - straggler_rules.yaml\nevaluation_interval: 1m\ntests:\n"
                       << "  - interval: 1m\n    input_series:\n"
                       << series << "    alert_rule_test:\n      - eval_time: 10m\n        alertname: TandemStraggler\n"
                       << "        exp_alerts:" << (alerts.empty() ? " []\n" : "\n" + alerts);
  const auto r = RunCommand({"/usr/bin/promtool", "test", "rules", tests}, std::chrono::seconds(30));
  return r.exit.success() ? "ok" : r.output + "\n" + ReadFile(tests);
}

TEST(StragglerProcessTest, ASlowedWorkerIsNamedByRankAndNodeWithinTwentyStepsAndNoOneElseIs) {
  testing::TempDir dir;
  // Without a straggler: no one is named, in the log, the status or the metric.
  const Outcome calm = Train(dir, "calm", "");
  ASSERT_TRUE(calm.failure.empty()) << calm.failure << "\n" << calm.coordinator_log;
  EXPECT_EQ(calm.coordinator_log.find("straggler:"), std::string::npos) << calm.coordinator_log;
  EXPECT_TRUE(calm.named_seen.empty()) << calm.named_seen.front();
  EXPECT_NE(calm.status_json.find("\"straggler\""), std::string::npos) << "every worker has a score\n"
                                                                       << calm.status_json;
  for (const char* rank : {"0", "1", "2", "3"}) {
    EXPECT_EQ(Sample(calm.metrics, "tandem_coordinator_straggler", rank), 0) << rank << "\n" << calm.metrics;
    EXPECT_GE(Sample(calm.metrics, "tandem_coordinator_straggler_score", rank), 0) << rank;
  }
  const std::string alert = CheckAlert(dir, calm.metrics, {});
  EXPECT_TRUE(alert == "ok" || alert == "skipped") << alert;
  ASSERT_GE(calm.step_seconds.size(), static_cast<size_t>(kSteps));

  // Worker 3 slowed from step 12 on by a sleep as long as the calm run's
  // step before each of its steps. With six processes on two cores part of
  // a sleep is hidden (the other workers compute faster meanwhile): the
  // job's steps become about 1.5 times longer (the context prints by how
  // much).
  const double step = Median({calm.step_seconds.begin() + 5, calm.step_seconds.end()});
  const int delay_ms = std::max(20, static_cast<int>(step * 1e3));
  const Outcome slow =
      Train(dir, "slow",
            "train.step_delay_ms=" + std::to_string(delay_ms) + ",train.step_delay_from=" + std::to_string(kSlowFrom));
  ASSERT_TRUE(slow.failure.empty()) << slow.failure << "\n" << slow.coordinator_log;
  const double slowed = slow.step_seconds.size() > kSlowFrom + 2
                            ? Median({slow.step_seconds.begin() + kSlowFrom + 2, slow.step_seconds.end()})
                            : 0;
  const std::string context =
      fmt::format("calm step {:.3f} s, delay {} ms, slowed step {:.3f} s ({:.2f}x)\n{}\n{}", step, delay_ms, slowed,
                  slowed / step, slow.coordinator_log, slow.status_json);
  std::cout << context.substr(0, context.find('\n')) << ", named at step " << slow.first_named_step << "\n";
  // The log line names it by rank and node, once.
  const std::regex named(
      R"(straggler: rank 3 on node node-1 \('worker-3', member \d+\) held up \d+ of the last \d+ steps, by \d+ ms on average: the job spends \d+% of its step time waiting for it \(score ([0-9.]+), step (\d+)\))");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(slow.coordinator_log, m, named)) << context;
  EXPECT_GE(std::stod(m[1].str()), 0.15) << context;
  EXPECT_LE(std::stoull(m[2].str()), kSlowFrom + 20) << context;
  EXPECT_GE(std::stoull(m[2].str()), kSlowFrom) << context;
  EXPECT_EQ(slow.coordinator_log.find("straggler: rank", static_cast<size_t>(m.position()) + 1), std::string::npos)
      << "named once, and no one else\n"
      << context;
  // `tandem status` showed it, and only it, named from within 20 steps.
  EXPECT_EQ(slow.named_seen, std::vector<std::string>{"rank 3 on node-1"}) << context;
  EXPECT_GE(slow.first_named_step, kSlowFrom) << context;
  EXPECT_LE(slow.first_named_step, kSlowFrom + 20) << context;
  // The metric, and the alert the shipped rules raise from it.
  EXPECT_EQ(Sample(slow.metrics, "tandem_coordinator_straggler", "3"), 1) << slow.metrics;
  EXPECT_GE(Sample(slow.metrics, "tandem_coordinator_straggler_score", "3"), 0.15) << slow.metrics;
  for (const char* rank : {"0", "1", "2"}) {
    EXPECT_EQ(Sample(slow.metrics, "tandem_coordinator_straggler", rank), 0) << rank << "\n" << slow.metrics;
  }
  const std::string fired = CheckAlert(dir, slow.metrics, {{"3", "node-1"}});
  EXPECT_TRUE(fired == "ok" || fired == "skipped") << fired;
}

}  // namespace
}  // namespace tandem
