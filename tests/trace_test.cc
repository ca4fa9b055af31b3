// Timeline traces (common/trace.h, common/trace_clock.h, cli/trace_merge.h):
// the recorder, the step range, the offset estimator, the trace clock's round
// trips over gRPC, the frame's correlation id, and merging with clocks skewed.
#include "common/trace.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "cli/trace_json.h"
#include "cli/trace_merge.h"
#include "common/grpc_util.h"
#include "common/ps_protocol.h"
#include "common/trace_clock.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;

std::string TempDir(const std::string& what) {
  std::string dir = fs::temp_directory_path() / fmt::format("tandem-trace-test-{}-{}", what, getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::vector<cli::JValue> ReadLines(const std::string& path) {
  std::vector<cli::JValue> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    auto v = cli::JsonReader(line).Document();
    EXPECT_TRUE(v.ok()) << line;
    if (v.ok()) out.push_back(std::move(*v));
  }
  return out;
}

cli::JValue ReadJson(const std::string& path) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto v = cli::JsonReader(text).Document();
  EXPECT_TRUE(v.ok()) << v.status().ToString();
  return v.ok() ? *v : cli::JValue{};
}

TEST(TraceTest, StepRangesParse) {
  auto all = trace::ParseStepRange("");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->first, 0u);
  EXPECT_EQ(all->last, UINT64_MAX);
  auto window = trace::ParseStepRange("10:20");
  ASSERT_TRUE(window.ok());
  EXPECT_TRUE(window->Contains(10));
  EXPECT_TRUE(window->Contains(20));
  EXPECT_FALSE(window->Contains(9));
  EXPECT_FALSE(window->Contains(21));
  auto from = trace::ParseStepRange("5:");
  ASSERT_TRUE(from.ok());
  EXPECT_EQ(from->first, 5u);
  EXPECT_EQ(from->last, UINT64_MAX);
  auto upto = trace::ParseStepRange(":7");
  ASSERT_TRUE(upto.ok());
  EXPECT_EQ(upto->last, 7u);
  auto one = trace::ParseStepRange("3");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->first, 3u);
  EXPECT_EQ(one->last, 3u);
  for (const char* bad : {"a:b", "20:10", "1:2:3", "-1", ":x"}) {
    auto r = trace::ParseStepRange(bad);
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(TraceTest, OffRecordsNothingAndCostsOneCheck) {
  ASSERT_FALSE(trace::On());
  EXPECT_FALSE(trace::StepOn(1));
  trace::Span span("forward", "compute", 1);
  EXPECT_FALSE(span.on());
  trace::Complete("x", "y", 0, 1, 1);  // nowhere to go: ignored
  EXPECT_TRUE(trace::Path().empty());
}

TEST(TraceTest, RecordsSpansOfTheStepRangeWithThreadsTracksAndProcessInfo) {
  const std::string dir = TempDir("recorder");
  trace::Config config;
  config.dir = dir + "/sub";  // created
  config.steps = "2:3";
  ASSERT_TRUE(trace::Start(config, "worker", "worker-7").ok());
  EXPECT_FALSE(trace::Start(config, "worker", "again").ok());
  const std::string path = trace::Path();
  EXPECT_EQ(path, fmt::format("{}/sub/worker-7-{}.trace.jsonl", dir, getpid()));
  trace::SetThreadName("train");
  trace::SetProcessInfo("rank", int64_t{3});
  trace::SetProcessInfo("node", "node-1");
  for (uint64_t step = 1; step <= 4; ++step) {
    trace::Span outer("step", "step", step);
    outer.Add("rank", 3);
    {
      trace::Span inner("forward", "compute", step);
      inner.Add("micro", 0);
      inner.Text("group", "node/0");
    }
  }
  trace::CompleteOnTrack("partition", 4, "aggregation", "ps", 100, 200, 2, {{"last_contributor", 1}});
  std::thread other([] {
    trace::SetThreadName("comm");
    trace::Complete("reduce_scatter", "comm", trace::Now(), trace::Now() + 10, 3, {{"bytes", 4096}}, "group", "node");
  });
  other.join();
  trace::RecordClockSample("ref", 1, 2, 3, 4);
  trace::Instant("epoch", "membership", trace::Now(), 0, {{"epoch", 2}});
  trace::Stop();
  EXPECT_FALSE(trace::On());

  const auto lines = ReadLines(path);
  ASSERT_GE(lines.size(), 3u);
  EXPECT_EQ(lines.front().Str("type"), "process");
  EXPECT_EQ(lines.front().Str("role"), "worker");
  EXPECT_EQ(lines.front().Str("name"), "worker-7");
  EXPECT_EQ(lines.front().Int("pid"), getpid());
  EXPECT_EQ(lines.front().Int("first_step"), 2);
  EXPECT_EQ(lines.front().Int("last_step"), 3);
  EXPECT_EQ(lines.back().Str("type"), "end");
  std::map<std::string, int> names;
  std::map<int64_t, std::string> threads;
  int steps = 0, clock = 0, rank_info = 0;
  for (const auto& l : lines) {
    if (l.Str("type") == "thread") threads[l.Int("tid")] = l.Str("name");
    if (l.Str("type") == "clock") ++clock;
    if (l.Str("type") == "process" && l.Find("rank") != nullptr) rank_info = static_cast<int>(l.Int("rank"));
    if (!l.Str("ph").empty()) {
      ++names[l.Str("name")];
      if (l.Str("name") == "step") {
        ++steps;
        EXPECT_GE(l.Int("step"), 2);
        EXPECT_LE(l.Int("step"), 3);
        EXPECT_EQ(l.Find("args")->Int("rank"), 3);
      }
      if (l.Str("name") == "forward") {
        EXPECT_EQ(l.Find("args")->Str("group"), "node/0");
      }
      if (l.Str("name") == "aggregation") {
        EXPECT_EQ(l.Int("tid"), -1);
        EXPECT_EQ(l.Int("dur"), 100);
      }
    }
  }
  EXPECT_EQ(steps, 2);  // steps 1 and 4 are outside 2:3
  EXPECT_EQ(names["forward"], 2);
  EXPECT_EQ(names["reduce_scatter"], 1);
  EXPECT_EQ(names["epoch"], 1);
  EXPECT_EQ(clock, 1);
  EXPECT_EQ(rank_info, 3);
  EXPECT_EQ(threads[-1], "partition 4");
  EXPECT_EQ(threads[gettid()], "train");
  int comm = 0;
  for (const auto& [tid, name] : threads) comm += name == "comm";
  EXPECT_EQ(comm, 1);
  // A span nested in another on one thread lies inside it.
  std::vector<std::pair<int64_t, int64_t>> outer, inner;
  for (const auto& l : lines) {
    if (l.Str("name") == "step") outer.emplace_back(l.Int("ts"), l.Int("ts") + l.Int("dur"));
    if (l.Str("name") == "forward") inner.emplace_back(l.Int("ts"), l.Int("ts") + l.Int("dur"));
  }
  ASSERT_EQ(outer.size(), inner.size());
  for (size_t i = 0; i < outer.size(); ++i) {
    EXPECT_LE(outer[i].first, inner[i].first);
    EXPECT_GE(outer[i].second, inner[i].second);
  }
  fs::remove_all(dir);
}

TEST(TraceTest, OffsetIsTheLeastDelayedRoundTrips) {
  // The local clock is 250 ms behind the reference: reference = local + 250 ms.
  const int64_t skew = 250'000'000;
  std::vector<trace::ClockSample> samples;
  // Asymmetric delays: the estimate of each is off by half the asymmetry.
  const std::vector<std::pair<int64_t, int64_t>> legs = {{900'000, 100'000}, {60'000, 40'000}, {300'000, 2'000'000}};
  int64_t t = 1'000'000'000;
  for (const auto& [out, back] : legs) {
    trace::ClockSample s;
    s.t0 = t;
    s.t1 = t + out + skew;
    s.t2 = s.t1 + 5'000;  // the reference's handling
    s.t3 = t + out + 5'000 + back;
    samples.push_back(s);
    t += 10'000'000;
  }
  samples.push_back({5, 1, 0, 4});  // not a round trip: ignored
  const trace::OffsetEstimate est = trace::EstimateOffset(samples);
  EXPECT_EQ(est.samples, 3u);
  EXPECT_EQ(est.delay_ns, 100'000);         // the second round trip's
  EXPECT_EQ(est.offset_ns, skew + 10'000);  // off by (60 - 40) / 2 us
  EXPECT_LE(std::abs(est.offset_ns - skew), est.delay_ns / 2);
  EXPECT_EQ(trace::EstimateOffset({}).samples, 0u);
}

// A reference whose trace clock is `skew_ns` ahead of this process's.
class SkewedClock final : public v1::TraceClock::CallbackService {
 public:
  explicit SkewedClock(int64_t skew_ns) : skew_(skew_ns) {}
  grpc::ServerUnaryReactor* Sample(grpc::CallbackServerContext* context, const v1::TraceClockRequest*,
                                   v1::TraceClockResponse* response) override {
    response->set_receive_ns(trace::Now() + skew_);
    response->set_clock_id("reference-host/boot");
    response->set_send_ns(trace::Now() + skew_);
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  int64_t skew_;
};

TEST(TraceTest, ClockSamplerMeasuresASkewedReferenceOverGrpc) {
  const int64_t skew = -1'234'000'000;  // the reference runs 1.234 s behind
  SkewedClock service(skew);
  GrpcServerConfig server_config;
  server_config.listen_address = "127.0.0.1:0";
  auto server = GrpcServer::Start(server_config, {{"tandem.v1.TraceClock", &service}});
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const std::string dir = TempDir("sampler");
  trace::Config config;
  config.dir = dir;
  ASSERT_TRUE(trace::Start(config, "worker", "sampler").ok());
  const std::string path = trace::Path();
  {
    auto channel = MakeChannel((*server)->address(), TlsConfig{}, 1 << 20);
    ASSERT_TRUE(channel.ok());
    trace::ClockSamplerOptions options;
    options.burst = 8;
    options.burst_gap = std::chrono::milliseconds(5);
    trace::ClockSampler sampler(*channel, options);
    for (int i = 0; i < 400 && sampler.samples() < 8; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_GE(sampler.samples(), 8);
  }
  trace::Stop();
  std::vector<trace::ClockSample> samples;
  for (const auto& l : ReadLines(path)) {
    if (l.Str("type") != "clock") continue;
    EXPECT_EQ(l.Str("ref"), "reference-host/boot");
    samples.push_back({l.Int("t0"), l.Int("t1"), l.Int("t2"), l.Int("t3")});
  }
  ASSERT_GE(samples.size(), 8u);
  const trace::OffsetEstimate est = trace::EstimateOffset(samples);
  EXPECT_LE(std::abs(est.offset_ns - skew), est.delay_ns / 2 + 1) << "delay " << est.delay_ns;
  EXPECT_LT(est.delay_ns, 50'000'000);
  (*server)->Shutdown(std::chrono::milliseconds(0));
  fs::remove_all(dir);
}

TEST(TraceTest, FramesCarryTheCorrelationIdAndRepliesEchoIt) {
  ps::Frame push;
  EXPECT_EQ(ps::Correlation(push), 0u);
  const uint64_t id = trace::NewCorrelation();
  EXPECT_NE(id, 0u);
  EXPECT_LT(id, uint64_t{1} << 48);
  EXPECT_NE(trace::NewCorrelation(), id);
  ps::SetCorrelation(push, id);
  EXPECT_EQ(ps::Correlation(push), id);
  EXPECT_EQ(ps::Correlation(ps::ReplyTo(push, ps::FrameType::kPushReply)), id);
  // The layout is the one a peer without tracing reads: the id lies in the
  // bytes that were reserved, after flags.
  EXPECT_EQ(sizeof(ps::Frame), 80u);
  unsigned char bytes[sizeof(ps::Frame)];
  std::memcpy(bytes, &push, sizeof(push));
  uint16_t hi;
  uint32_t lo;
  std::memcpy(&hi, bytes + 74, 2);
  std::memcpy(&lo, bytes + 76, 4);
  EXPECT_EQ((uint64_t{hi} << 32) | lo, id);
}

// --- merging ------------------------------------------------------------------------------

// A synthetic trace file: `lines` after the process line.
void WriteTrace(const std::string& path, const std::string& process, const std::vector<std::string>& lines,
                bool end = true) {
  std::ofstream out(path);
  out << process << "\n";
  for (const auto& l : lines) out << l << "\n";
  if (end)
    out << R"({"type":"end","events":0,"dropped":0})"
        << "\n";
}

std::string Process(const std::string& role, const std::string& name, int pid, const std::string& clock, int64_t skew) {
  return fmt::format(
      R"({{"type":"process","version":1,"role":"{}","name":"{}","pid":{},"host":"h","clock":"{}","clock_skew_ns":{},"first_step":0,"last_step":-1,"start_ns":0}})",
      role, name, pid, clock, skew);
}

// Round trips to the reference from a process whose clock is `local_minus_ref`
// ahead of the reference's (local = reference + that).
std::vector<std::string> Samples(const std::string& ref, int64_t local_minus_ref) {
  std::vector<std::string> out;
  for (int i = 0; i < 5; ++i) {
    const int64_t true0 = 1'000'000'000 + i * 1'000'000;  // reference time of t0
    const int64_t rtt = 200'000 + i * 50'000;
    out.push_back(fmt::format(R"({{"type":"clock","ref":"{}","t0":{},"t1":{},"t2":{},"t3":{}}})", ref,
                              true0 + local_minus_ref, true0 + rtt / 2, true0 + rtt / 2 + 1000,
                              true0 + rtt + 1000 + local_minus_ref));
  }
  return out;
}

std::string Span(const std::string& name, int64_t ts, int64_t dur, int tid, uint64_t step, const std::string& args) {
  return fmt::format(R"({{"ph":"X","name":"{}","cat":"c","ts":{},"dur":{},"tid":{},"step":{},"args":{{{}}}}})", name,
                     ts, dur, tid, step, args);
}

TEST(TraceMergeTest, AlignsSkewedClocksAndLinksPushesToUpdates) {
  const std::string dir = TempDir("merge");
  const std::string ref = "coordinator-host/boot";
  // True (reference) times in ns: the worker pushes at 2.000 s, the server
  // takes it in at 2.001 s and updates at 2.003 s; the worker's clock is
  // 500 ms ahead of the reference, the server's 300 ms behind.
  const int64_t worker_skew = 500'000'000, server_skew = -300'000'000;
  WriteTrace(dir + "/coordinator-1.trace.jsonl", Process("coordinator", "coordinator", 1, ref, 0),
             {Span("epoch_published", 1'500'000'000, 10, 1, 0, "")});
  auto worker = Samples(ref, worker_skew);
  worker.push_back(R"({"type":"process","rank":0,"node":"node-0"})");
  worker.push_back(R"({"type":"thread","tid":11,"name":"comm"})");
  worker.push_back(Span("step", 1'990'000'000 + worker_skew, 30'000'000, 10, 5, ""));
  worker.push_back(Span("push", 2'000'000'000 + worker_skew, 20'000, 11, 5, R"("partition":3,"corr":77)"));
  worker.push_back(Span("push_reply", 2'001'500'000 + worker_skew, 0, 12, 5, R"("partition":3,"corr":77)"));
  worker.push_back(Span("pull", 2'000'030'000 + worker_skew, 10'000, 11, 5, R"("partition":3,"corr":78)"));
  worker.push_back(Span("pull_reply", 2'004'000'000 + worker_skew, 0, 12, 5, R"("partition":3,"corr":78)"));
  WriteTrace(dir + "/worker-0-10.trace.jsonl", Process("worker", "worker-0", 10, "worker-host/boot", 0), worker);
  auto server = Samples(ref, server_skew);
  server.push_back(R"({"type":"process","rank":0})");
  server.push_back(Span("push", 2'001'000'000 + server_skew, 50'000, 21, 5, R"("partition":3,"corr":77)"));
  server.push_back(Span("pull_recv", 2'001'100'000 + server_skew, 0, 21, 5, R"("partition":3,"corr":78)"));
  server.push_back(Span("update", 2'003'000'000 + server_skew, 400'000, 22, 5, R"("partition":3,"backup":0)"));
  server.push_back(Span("pull_answer", 2'003'500'000 + server_skew, 0, 22, 5, R"("partition":3,"corr":78)"));
  WriteTrace(dir + "/server-0-20.trace.jsonl", Process("server", "server-0", 20, "server-host/boot", 0), server);

  cli::TraceMergeOptions o;
  o.dir = dir;
  o.output = dir + "/merged.json";
  o.svg = dir + "/steps.svg";
  auto report = cli::MergeTraces(o);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->reference, ref);
  ASSERT_EQ(report->processes.size(), 3u);
  for (const auto& p : report->processes) {
    EXPECT_TRUE(p.aligned) << p.file;
    if (p.role == "worker") {
      EXPECT_NEAR(static_cast<double>(p.offset_ns), -worker_skew, 1000);
    }
    if (p.role == "server") {
      EXPECT_NEAR(static_cast<double>(p.offset_ns), -server_skew, 1000);
    }
  }
  EXPECT_EQ(report->pushes, 1u);
  EXPECT_EQ(report->pushes_linked, 1u);
  EXPECT_EQ(report->pulls_linked, 1u);
  EXPECT_TRUE(fs::exists(o.svg));

  const cli::JValue merged = ReadJson(o.output);
  const cli::JValue* events = merged.Find("traceEvents");
  ASSERT_NE(events, nullptr);
  std::map<std::string, double> at;  // span name -> ts in us (aligned)
  std::map<std::string, std::string> process_names;
  int flows_s = 0, flows_f = 0;
  for (const auto& e : events->array) {
    const std::string ph = e.Str("ph");
    if (ph == "X") at[e.Str("name") + "@" + std::to_string(e.Int("pid"))] = e.Find("ts")->d;
    if (ph == "M" && e.Str("name") == "process_name") {
      process_names[std::to_string(e.Int("pid"))] = e.Find("args")->Str("name");
    }
    if (ph == "s") ++flows_s;
    if (ph == "f") {
      ++flows_f;
      EXPECT_EQ(e.Str("bp"), "e");
    }
  }
  EXPECT_EQ(flows_s, 3);  // push -> update, push acknowledged, pull -> answer
  EXPECT_EQ(flows_f, 3);
  // pids: files in name order (coordinator 1, server 2, worker 3).
  EXPECT_EQ(process_names["3"], "worker-0 (rank 0) on node-0 pid 10");
  EXPECT_EQ(process_names["2"], "server-0 (server 0) pid 20");
  // On one clock: the push, then the server taking it in 1 ms later, the update 3 ms after the push.
  const double push = at["push@3"], taken = at["push@2"], update = at["update@2"];
  EXPECT_NEAR(taken - push, 1000.0, 1.0);
  EXPECT_NEAR(update - push, 3000.0, 1.0);
  EXPECT_NEAR(at["epoch_published@1"], 0.0, 1e-9);  // the earliest event is time 0
  EXPECT_NEAR(push - at["epoch_published@1"], 500'000.0, 1.0);
  fs::remove_all(dir);
}

TEST(TraceMergeTest, SaysWhatIsWrongWithMissingBadAndPartialFiles) {
  cli::TraceMergeOptions o;
  o.dir = "/nonexistent/tandem-trace";
  o.output = "/dev/null";
  auto missing = cli::MergeTraces(o);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  const std::string dir = TempDir("bad");
  o.dir = dir;
  auto empty = cli::MergeTraces(o);
  EXPECT_EQ(empty.status().code(), StatusCode::kNotFound);
  EXPECT_NE(empty.status().message().find("--trace"), std::string::npos);
  { std::ofstream(dir + "/x-1.trace.jsonl") << "{\"ph\":\"X\"}\n"; }
  auto bad = cli::MergeTraces(o);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("x-1.trace.jsonl:1"), std::string::npos) << bad.status().message();
  fs::remove(dir + "/x-1.trace.jsonl");
  // A process killed mid-write: its last line cut off, no end line. Merged, with warnings.
  {
    std::ofstream out(dir + "/worker-0-5.trace.jsonl");
    out << Process("worker", "worker-0", 5, "h/b", 0) << "\n"
        << Span("step", 100, 50, 5, 1, "") << "\n"
        << R"({"ph":"X","name":"forw)";
  }
  o.output = dir + "/merged.json";
  auto partial = cli::MergeTraces(o);
  ASSERT_TRUE(partial.ok()) << partial.status().ToString();
  EXPECT_EQ(partial->events, 1u);
  ASSERT_EQ(partial->warnings.size(), 2u);
  EXPECT_NE(partial->warnings[0].find("cut off"), std::string::npos);
  EXPECT_NE(partial->warnings[1].find("no end line"), std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tandem
