// A traced run (tandem run --trace, the default demo's cluster: 2 nodes of 2
// workers, 2 servers, hybrid mode) merged with tandem trace merge: the merged
// file is trace-event JSON with a track per process and the expected threads
// and spans, only the steps asked for, every traced push linked by a flow to
// its server's update, and spans that nest on each thread; one worker's
// clock skewed on purpose is aligned from its round trips.
#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "cli/trace_json.h"
#include "test_util.h"

namespace tandem {
namespace {

using testing::BinDir;
using testing::RunCommand;

std::vector<std::string> SplitLines(const std::string& text) {
  std::vector<std::string> lines;
  size_t from = 0;
  for (size_t nl; (nl = text.find('\n', from)) != std::string::npos; from = nl + 1) {
    lines.push_back(text.substr(from, nl - from));
  }
  if (from < text.size()) lines.push_back(text.substr(from));
  return lines;
}

struct Slice {
  std::string name;
  double begin, end;  // microseconds
  uint64_t step;
};

TEST(TraceProcessTest, ATracedDemoRunMergesIntoOneLinkedTimeline) {
  testing::TempDir dir;
  const std::string traces = dir.path() + "/trace";
  // worker-1's trace clock runs 250 ms ahead, as another machine's would:
  // the merge must put it back from its round trips to the coordinator.
  const auto run =
      RunCommand({"/usr/bin/env", "TANDEM_FAILPOINTS=trace.clock_skew_ms=worker-1:250", BinDir() + "/tandem", "run",
                  "--nodes", "2", "--workers-per-node", "2", "--servers", "2", "--steps", "10", "--trace", traces,
                  "--trace-steps", "4:8", "--work-dir", dir.path() + "/work"},
                 std::chrono::seconds(120));
  ASSERT_TRUE(run.exit.success()) << run.output;
  EXPECT_NE(run.output.find("trace: " + traces), std::string::npos) << run.output;
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(traces)) files += e.path().string().ends_with(".jsonl");
  EXPECT_EQ(files, 7u);  // coordinator, 2 servers, 4 workers

  const std::string merged = dir.path() + "/trace.json", svg = dir.path() + "/steps.svg";
  const auto merge = RunCommand({BinDir() + "/tandem", "trace", "merge", traces, "-o", merged, "--svg", svg},
                                std::chrono::seconds(60));
  ASSERT_TRUE(merge.exit.success()) << merge.output;
  EXPECT_EQ(merge.output.find("warning"), std::string::npos) << merge.output;
  EXPECT_EQ(merge.output.find("NOT ALIGNED"), std::string::npos) << merge.output;
  EXPECT_NE(testing::ReadFile(svg).find("rank 3 (worker-"), std::string::npos);
  // The skewed worker's offset, from round trips; the others share the coordinator's clock.
  for (const auto& line : SplitLines(merge.output)) {
    if (line.find(".trace.jsonl") == std::string::npos) continue;
    const size_t at = line.find("offset ");
    ASSERT_NE(at, std::string::npos) << line;
    const double offset_ms = std::stod(line.substr(at + 7));
    if (line.find("worker-1-") != std::string::npos) {
      EXPECT_NEAR(offset_ms, -250.0, 2.0) << line;
      EXPECT_NE(line.find("round trip"), std::string::npos) << line;
    } else {
      EXPECT_EQ(offset_ms, 0.0) << line;
      EXPECT_NE(line.find("the reference's clock"), std::string::npos) << line;
    }
  }

  auto parsed = cli::JsonReader(testing::ReadFile(merged)).Document();
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  const cli::JValue* events = parsed->Find("traceEvents");
  ASSERT_NE(events, nullptr);
  std::map<int64_t, std::string> process;                      // pid -> name
  std::map<std::pair<int64_t, int64_t>, std::string> threads;  // (pid, tid) -> name
  std::map<std::pair<int64_t, int64_t>, std::vector<Slice>> slices;
  std::map<int64_t, std::vector<std::string>> flow_starts, flow_ends;  // id -> names
  int reduce_scatters = 0, with_wait = 0, named_waits = 0;             // whom the node's reduce-scatters waited for
  std::map<int64_t, std::vector<double>> flow_times;                   // id -> ts of s, t..., f
  for (const auto& e : events->array) {
    const std::string ph = e.Str("ph");
    const auto key = std::make_pair(e.Int("pid"), e.Int("tid"));
    if (ph == "M" && e.Str("name") == "process_name") process[key.first] = e.Find("args")->Str("name");
    if (ph == "M" && e.Str("name") == "thread_name") threads[key] = e.Find("args")->Str("name");
    if (ph == "X" && e.Str("name") == "reduce_scatter") {
      ++reduce_scatters;
      const cli::JValue* waited = e.Find("args")->Find("waited_for");
      named_waits += waited != nullptr && waited->i >= 0;
      with_wait += waited != nullptr;
    }
    if (ph == "X") {
      const double ts = e.Find("ts")->d, dur = e.Find("dur")->d;
      slices[key].push_back({e.Str("name"), ts, ts + dur, static_cast<uint64_t>(e.Find("args")->Int("step"))});
    }
    if (ph == "s" || ph == "t" || ph == "f") flow_times[e.Int("id")].push_back(e.Find("ts")->d);
    if (ph == "s") flow_starts[e.Int("id")].push_back(e.Str("name"));
    if (ph == "f") flow_ends[e.Int("id")].push_back(e.Str("name"));
  }
  // Every reduce-scatter says whom it waited for; the shared-memory backend
  // (the nodes' groups) names the rank that entered last.
  EXPECT_GT(reduce_scatters, 0);
  EXPECT_EQ(with_wait, reduce_scatters);
  EXPECT_GT(named_waits, 0);
  // A track per process, named by role, rank and node.
  std::map<std::string, int> roles;
  for (const auto& [pid, name] : process) {
    for (const std::string role : {"coordinator", "server-", "worker-"}) roles[role] += name.starts_with(role);
  }
  EXPECT_EQ(roles["coordinator"], 1);
  EXPECT_EQ(roles["server-"], 2);
  EXPECT_EQ(roles["worker-"], 4);
  for (const auto& [pid, name] : process) {
    if (name.starts_with("worker-")) {
      EXPECT_NE(name.find("(rank "), std::string::npos) << name;
    }
  }
  // Per worker: the training and communication threads, with the steps asked
  // for and their spans.
  int workers = 0;
  uint64_t pushes = 0;
  for (const auto& [pid, name] : process) {
    if (!name.starts_with("worker-")) continue;
    ++workers;
    std::map<std::string, int> names;
    std::set<uint64_t> steps;
    for (const auto& [key, list] : slices) {
      if (key.first != pid) continue;
      const std::string thread = threads[key];
      for (const Slice& s : list) {
        ++names[thread + "/" + s.name];
        if (s.name == "step") steps.insert(s.step);
        if (s.name == "push") ++pushes;
        EXPECT_GE(s.step, 4u) << name << " " << s.name;
        EXPECT_LE(s.step, 8u) << name << " " << s.name;
      }
    }
    EXPECT_EQ(steps, (std::set<uint64_t>{4, 5, 6, 7, 8})) << name;
    for (const std::string span :
         {"train/step", "train/forward", "train/backward", "train/end_step_wait", "comm/bucket", "comm/reduce_scatter",
          "comm/push", "comm/push_wait", "comm/pull_wait", "comm/all_gather", "comm/loss_allreduce"}) {
      EXPECT_GE(names[span], 5) << name << ": " << span;
    }
  }
  EXPECT_EQ(workers, 4);
  for (const auto& [pid, name] : process) {
    if (!name.starts_with("server-")) continue;
    std::map<std::string, int> names;
    for (const auto& [key, list] : slices) {
      if (key.first != pid) continue;
      for (const Slice& s : list) ++names[s.name];
    }
    for (const std::string span : {"push", "aggregation", "update", "decide", "pull_answer"}) {
      EXPECT_GE(names[span], 5) << name << ": " << span;
    }
  }
  // Every traced push is linked by a flow that ends at its server's update.
  ASSERT_GT(pushes, 0u);
  uint64_t linked = 0;
  for (const auto& [id, names] : flow_starts) {
    if (names.front() != "push -> update") continue;
    ++linked;
    EXPECT_EQ(flow_ends[id].size(), 1u) << "flow " << id;
  }
  EXPECT_EQ(linked, pushes);
  // Aligned clocks keep cause before effect: the server takes a push in
  // after the worker sent it, and updates after that (within the alignment's
  // error, well under the 250 ms skew).
  for (const auto& [id, names] : flow_starts) {
    if (names.front() != "push -> update") continue;
    const std::vector<double>& ts = flow_times[id];
    ASSERT_EQ(ts.size(), 3u) << "flow " << id;
    EXPECT_GE(ts[1], ts[0] - 2000) << "flow " << id;
    EXPECT_GE(ts[2], ts[1] - 2000) << "flow " << id;
  }
  EXPECT_NE(merge.output.find(fmt::format("pushes linked to their update: {} of {}", pushes, pushes)),
            std::string::npos)
      << merge.output;
  // On each thread, spans nest: one that starts inside another ends inside it.
  for (auto& [key, list] : slices) {
    std::sort(list.begin(), list.end(),
              [](const Slice& a, const Slice& b) { return std::tie(a.begin, b.end) < std::tie(b.begin, a.end); });
    std::vector<const Slice*> open;
    for (const Slice& s : list) {
      while (!open.empty() && open.back()->end <= s.begin) open.pop_back();
      if (!open.empty()) {
        EXPECT_LE(s.end, open.back()->end)
            << process[key.first] << "/" << threads[key] << ": " << s.name << " [" << s.begin << ", " << s.end
            << "] overlaps " << open.back()->name << " [" << open.back()->begin << ", " << open.back()->end << "]";
      }
      open.push_back(&s);
    }
  }
  // A worker's steps follow one another, and its computation and exposed
  // wait lie inside their step.
  for (const auto& [key, list] : slices) {
    if (threads[key] != "train") continue;
    std::map<uint64_t, const Slice*> step;
    for (const Slice& s : list) {
      if (s.name == "step") step[s.step] = &s;
    }
    const Slice* before = nullptr;
    for (const auto& [n, s] : step) {
      if (before != nullptr) {
        EXPECT_LE(before->end, s->begin) << process[key.first] << " step " << n;
      }
      before = s;
    }
    for (const Slice& s : list) {
      if (s.name != "forward" && s.name != "backward" && s.name != "end_step_wait") continue;
      ASSERT_TRUE(step.count(s.step)) << s.name << " of step " << s.step;
      EXPECT_GE(s.begin, step[s.step]->begin) << s.name;
      EXPECT_LE(s.end, step[s.step]->end) << s.name;
    }
  }
}

}  // namespace
}  // namespace tandem
