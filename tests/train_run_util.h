// Running `tandem train` and `tandem run` from a test and comparing what
// they trained (tests/train_process_test.cc has the tolerances' reasons).
#pragma once

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include "launch_util.h"
#include "test_util.h"

namespace tandem {

using testing::BinDir;
using testing::ReadFile;
using testing::RunCommand;

constexpr double kLr = 3e-3;  // the trainer's default

inline const std::vector<std::string>& Model() {
  static const std::vector<std::string> m = {"--train-layers",       "2", "--train-d-model", "32",
                                             "--train-heads",        "2", "--train-context", "16",
                                             "--train-global-batch", "8"};
  return m;
}

struct Outcome {
  std::string output;
  bool ok = false;
  YAML::Node summary;
  std::vector<float> params;
  std::string work_dir;
};

inline std::vector<float> ReadParams(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<float> p;
  float v;
  while (in.read(reinterpret_cast<char*>(&v), sizeof v)) p.push_back(v);
  return p;
}

// `prefix` goes before the binary (for example /usr/bin/env and a variable).
inline Outcome Invoke(const testing::TempDir& dir, const std::string& name, std::vector<std::string> args,
                      std::vector<std::string> prefix = {}) {
  Outcome o;
  const std::string summary = dir.path() + "/" + name + ".json";
  std::vector<std::string> argv = std::move(prefix);
  argv.push_back(BinDir() + "/tandem");
  argv.insert(argv.end(), args.begin(), args.end());
  argv.insert(argv.end(), Model().begin(), Model().end());
  argv.insert(argv.end(), {"--summary", summary});
  const bool run = args.front() == "run";
  if (run) argv.insert(argv.end(), {"--work-dir", dir.path() + "/" + name, "--timeout", "100s"});
  if (!run) argv.insert(argv.end(), {"--train-params-out", dir.path() + "/" + name + ".params"});
  auto r = RunCommand(argv, std::chrono::seconds(110));
  o.output = r.output;
  o.ok = r.exit.success();
  try {
    o.summary = YAML::LoadFile(summary);
  } catch (const std::exception& e) {
    o.output += std::string("\n[no summary: ") + e.what() + "]";
    o.ok = false;
  }
  o.work_dir = dir.path() + "/" + name;
  o.params = ReadParams(run ? o.work_dir + "/params.bin" : dir.path() + "/" + name + ".params");
  return o;
}

// The servers' update count; -1 when they disagree or could not be asked
// (the run's output then says which server had what).
inline int Applied(const YAML::Node& summary) {
  const YAML::Node n = summary["server_steps_applied"];
  return n && !n.IsNull() ? n.as<int>() : -1;
}

// Parameters and loss curves within the bounds above.
inline void ExpectSameTraining(const Outcome& a, const Outcome& b, const std::string& optimizer) {
  ASSERT_EQ(a.params.size(), b.params.size());
  ASSERT_FALSE(a.params.empty());
  double max_diff = 0, sum_diff = 0;
  for (size_t i = 0; i < a.params.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a.params[i]) - b.params[i]);
    max_diff = std::max(max_diff, d);
    sum_diff += d;
  }
  const double mean_diff = sum_diff / static_cast<double>(a.params.size());
  if (optimizer == "sgd") {
    EXPECT_LT(max_diff, 1e-6);
  } else {
    EXPECT_LT(max_diff, 0.01 * kLr);
    EXPECT_LT(mean_diff, 1e-4 * kLr);
  }
  // A step that completed on the servers while rank 0 lost its result has
  // no loss (null).
  const auto losses = [](const YAML::Node& list) {
    std::vector<double> v;
    for (const auto& x : list) v.push_back(x.IsNull() ? std::nan("") : x.as<double>());
    return v;
  };
  const auto la = losses(a.summary["losses"]);
  const auto lb = losses(b.summary["losses"]);
  ASSERT_EQ(la.size(), lb.size());
  int compared = 0;
  for (size_t i = 0; i < la.size(); ++i) {
    if (std::isnan(la[i]) || std::isnan(lb[i])) continue;
    EXPECT_NEAR(la[i], lb[i], 1e-4) << "step " << i + 1;
    ++compared;
  }
  EXPECT_GE(compared, static_cast<int>(la.size()) - 2);
}

}  // namespace tandem
