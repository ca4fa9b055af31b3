// tandem trace merge (trace_merge.h): reading the per-process trace files,
// aligning their clocks, and writing one Chrome trace-event file and the
// step breakdown chart.
#include "cli/trace_merge.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <unordered_map>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/trace_json.h"
#include "common/json.h"
#include "common/trace.h"

namespace tandem::cli {
namespace {

// --- one process's file -----------------------------------------------------------------------

struct Event {
  JValue json;  // the line
  char ph = 'X';
  std::string name;
  int64_t ts = 0, dur = 0, tid = 0;
  uint64_t step = 0;
};

struct ProcessTrace {
  std::string file;
  std::map<std::string, JValue> info;  // from the "process" lines (later keys win)
  std::map<int64_t, std::string> threads;
  std::map<std::string, std::vector<trace::ClockSample>> clock;  // by reference
  std::vector<Event> events;
  bool ended = false;
  // The rank the track is labelled with: a worker's in its first traced
  // step, else the first one the process learned (ranks change with
  // membership, and a run's end changes them all). -1: none.
  int64_t rank = -1;
  std::string Info(const std::string& key) const {
    auto it = info.find(key);
    return it != info.end() && it->second.type == JValue::kString ? it->second.s : std::string();
  }
  int64_t InfoInt(const std::string& key, int64_t fallback) const {
    auto it = info.find(key);
    return it != info.end() && it->second.type == JValue::kNumber ? it->second.i : fallback;
  }
};

Result<ProcessTrace> ReadTrace(const std::filesystem::path& path, std::vector<std::string>* warnings) {
  std::ifstream in(path);
  if (!in) return Unavailable("cannot read '{}': {}", path.string(), std::strerror(errno));
  ProcessTrace p;
  p.file = path.filename().string();
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(std::move(line));
  if (lines.empty()) return InvalidArgument("{}: empty, not a Tandem trace file", p.file);
  for (size_t n = 0; n < lines.size(); ++n) {
    if (lines[n].empty()) continue;
    auto parsed = JsonReader(lines[n]).Document();
    if (!parsed.ok() || parsed->type != JValue::kObject) {
      if (n + 1 == lines.size() && n > 0) {
        warnings->push_back(
            fmt::format("{}: the last line is cut off (the process died while writing); ignored", p.file));
        break;
      }
      return InvalidArgument("{}:{}: not a trace line ({})", p.file, n + 1,
                             parsed.ok() ? "not a JSON object" : parsed.status().message());
    }
    JValue& v = *parsed;
    const std::string type = v.Str("type");
    if (n == 0 && type != "process") {
      return InvalidArgument("{}:1: a Tandem trace file begins with its process line (\"type\":\"process\")", p.file);
    }
    if (type == "process") {
      for (size_t i = 0; i < v.keys.size(); ++i) {
        const std::string& k = v.keys[i];
        const JValue& item = v.values[i];
        if (k == "rank" && p.rank < 0 && item.type == JValue::kNumber) p.rank = item.i;
        if (k != "type") p.info[k] = item;
      }
    } else if (type == "thread") {
      p.threads[v.Int("tid")] = v.Str("name");
    } else if (type == "clock") {
      p.clock[v.Str("ref")].push_back({v.Int("t0"), v.Int("t1"), v.Int("t2"), v.Int("t3")});
    } else if (type == "end") {
      p.ended = true;
    } else if (type.empty()) {
      Event e;
      const std::string ph = v.Str("ph");
      e.ph = ph.empty() ? 'X' : ph[0];
      e.name = v.Str("name");
      e.ts = v.Int("ts");
      e.dur = v.Int("dur");
      e.tid = v.Int("tid");
      e.step = static_cast<uint64_t>(v.Int("step"));
      if (e.name.empty() || (e.ph != 'X' && e.ph != 'i')) {
        return InvalidArgument("{}:{}: an event needs a name and ph X or i", p.file, n + 1);
      }
      e.json = std::move(v);
      p.events.push_back(std::move(e));
    }
  }
  int64_t first_step_ts = INT64_MAX;
  for (const Event& e : p.events) {
    const JValue* args = e.json.Find("args");
    if (e.name == "step" && e.ts < first_step_ts && args != nullptr && args->Find("rank") != nullptr) {
      first_step_ts = e.ts;
      p.rank = args->Int("rank");
    }
  }
  if (p.info.find("role") == p.info.end() || p.info.find("pid") == p.info.end()) {
    return InvalidArgument("{}: the process line has no role or pid", p.file);
  }
  if (!p.ended) {
    warnings->push_back(fmt::format(
        "{}: no end line: the process did not stop cleanly (killed?), so up to its last 200 ms are missing", p.file));
  }
  return p;
}

// The args of an event as JSON, with its step.
std::string ArgsJson(const Event& e) {
  std::string out = fmt::format("{{\"step\":{}", e.step);
  if (const JValue* args = e.json.Find("args"); args != nullptr && args->type == JValue::kObject) {
    for (size_t i = 0; i < args->keys.size(); ++i) {
      const std::string& k = args->keys[i];
      const JValue& v = args->values[i];
      if (v.type == JValue::kNumber) {
        out += fmt::format(",{}:{}", JsonQuote(k), v.integral ? fmt::format("{}", v.i) : fmt::format("{}", v.d));
      } else if (v.type == JValue::kString) {
        out += fmt::format(",{}:{}", JsonQuote(k), JsonQuote(v.s));
      }
    }
  }
  return out + "}";
}

int64_t ArgInt(const Event& e, std::string_view key, int64_t fallback = -1) {
  const JValue* args = e.json.Find("args");
  return args != nullptr ? args->Int(key, fallback) : fallback;
}

std::string Us(int64_t ns) {
  return fmt::format("{}.{:03d}", ns / 1000, static_cast<int>(std::abs(ns % 1000)));
}

// Sort order of a process's track: coordinator, servers, workers by rank.
int64_t SortKey(const ProcessTrace& p) {
  const std::string role = p.Info("role");
  const int64_t rank = p.rank >= 0 ? p.rank : 9999;
  if (role == "coordinator") return 0;
  if (role == "server") return 100 + rank;
  return 10000 + rank;
}

int ThreadOrder(const std::string& name) {
  if (name == "main") return 9;
  if (name == "train") return 0;
  if (name == "comm") return 1;
  return 5;
}

// --- the step breakdown chart -----------------------------------------------------------------

struct Breakdown {
  double step = 0, compute = 0, wait = 0;                                    // training thread
  double reduce_scatter = 0, push = 0, pull = 0, all_gather = 0, other = 0;  // communication thread
};

std::string Svg(const std::vector<std::pair<std::string, std::map<uint64_t, Breakdown>>>& rows) {
  uint64_t first = UINT64_MAX, last = 0;
  double longest = 0;
  for (const auto& [name, steps] : rows) {
    for (const auto& [s, b] : steps) {
      first = std::min(first, s);
      last = std::max(last, s);
      longest = std::max({longest, b.step, b.reduce_scatter + b.push + b.pull + b.all_gather + b.other});
    }
  }
  if (rows.empty() || first > last) return {};
  const size_t nsteps = last - first + 1;
  const double slot = std::clamp(900.0 / static_cast<double>(nsteps), 6.0, 40.0);
  const double left = 150, top = 50, panel = 150, gap = 30;
  const double width = left + slot * static_cast<double>(nsteps) + 40;
  const double height = top + (panel + gap) * static_cast<double>(rows.size()) + 60;
  const double scale = longest > 0 ? (panel - 10) / longest : 1;
  struct Part {
    const char* label;
    const char* color;
    double Breakdown::*field;
    bool comm;
  };
  const Part parts[] = {{"compute", "#4e79a7", &Breakdown::compute, false},
                        {"exposed wait", "#e15759", &Breakdown::wait, false},
                        {"reduce-scatter", "#f28e2b", &Breakdown::reduce_scatter, true},
                        {"push", "#59a14f", &Breakdown::push, true},
                        {"pull", "#76b7b2", &Breakdown::pull, true},
                        {"all-gather", "#edc948", &Breakdown::all_gather, true},
                        {"other collectives", "#b07aa1", &Breakdown::other, true}};
  std::string out = fmt::format(
      R"(<svg xmlns="http://www.w3.org/2000/svg" width="{:.0f}" height="{:.0f}" font-family="sans-serif" font-size="11">)"
      "\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      R"(<text x="{}" y="20" font-size="14">Step breakdown per rank (ms): left bar the training thread (compute, exposed wait; the outline is the step), right bar the communication thread</text>)"
      "\n",
      width, height, left);
  double lx = left;
  for (const Part& part : parts) {
    out += fmt::format(R"(<rect x="{:.0f}" y="30" width="10" height="10" fill="{}"/><text x="{:.0f}" y="39">{}</text>)"
                       "\n",
                       lx, part.color, lx + 14, part.label);
    lx += 14 + 7.0 * static_cast<double>(std::strlen(part.label)) + 16;
  }
  for (size_t r = 0; r < rows.size(); ++r) {
    const double y0 = top + static_cast<double>(r) * (panel + gap) + panel;  // the panel's baseline
    out += fmt::format(R"(<text x="10" y="{:.0f}">{}</text>)"
                       "\n",
                       y0 - panel / 2, rows[r].first);
    out += fmt::format(R"(<line x1="{}" y1="{:.0f}" x2="{:.0f}" y2="{:.0f}" stroke="#888"/>)"
                       "\n",
                       left, y0, width - 40, y0);
    out += fmt::format(R"(<text x="{}" y="{:.0f}" text-anchor="end" fill="#555">{:.1f}</text>)"
                       "\n",
                       left - 4, y0 - panel + 14, longest * 1e3);
    for (const auto& [s, b] : rows[r].second) {
      const double x = left + slot * static_cast<double>(s - first);
      const double w = std::max(1.0, slot / 2 - 1);
      double y = y0, yc = y0;
      for (const Part& part : parts) {
        const double h = (b.*part.field) * scale;
        if (h <= 0) continue;
        double& at = part.comm ? yc : y;
        at -= h;
        out += fmt::format(
            R"(<rect x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{:.1f}" fill="{}"><title>{} step {}: {} {:.2f} ms</title></rect>)"
            "\n",
            part.comm ? x + w + 1 : x, at, w, h, part.color, rows[r].first, s, part.label, (b.*part.field) * 1e3);
      }
      out += fmt::format(
          R"(<rect x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{:.1f}" fill="none" stroke="black" stroke-width="0.6"><title>{} step {}: {:.2f} ms</title></rect>)"
          "\n",
          x, y0 - b.step * scale, w, b.step * scale, rows[r].first, s, b.step * 1e3);
    }
    const uint64_t every = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(40.0 / slot)));
    for (uint64_t s = first; s <= last; s += every) {
      out += fmt::format(R"(<text x="{:.1f}" y="{:.0f}" fill="#555">{}</text>)"
                         "\n",
                         left + slot * static_cast<double>(s - first), y0 + 12, s);
    }
  }
  out += fmt::format(R"(<text x="{}" y="{:.0f}" fill="#555">step</text>)"
                     "\n</svg>\n",
                     left, height - 10);
  return out;
}

// The track id of a thread: recorded ids as they are, the recorder's
// negative ones (tracks of their own, e.g. a partition's aggregation) after them.
int64_t TrackTid(int64_t tid) {
  return tid < 0 ? 900000000 - tid : tid;
}

using Emit = std::function<void(const std::string&)>;

// The clock the merged trace is on: the one most processes measured
// themselves against (or, with none, the host's when all ran on one).
std::string ChooseReference(const std::vector<ProcessTrace>& procs, std::vector<std::string>* warnings) {
  // The reference: the clock most processes measured themselves against.
  std::map<std::string, size_t> votes;
  for (const auto& p : procs) {
    for (const auto& [ref, samples] : p.clock) votes[ref] += 1;
  }
  std::string reference;
  size_t best = 0;
  for (const auto& [ref, n] : votes) {
    if (n > best) {
      best = n;
      reference = ref;
    }
  }
  if (reference.empty()) {
    // Nobody sampled a reference (no coordinator): processes of one host share its clock.
    std::set<std::string> clocks;
    for (const auto& p : procs) clocks.insert(p.Info("clock"));
    reference = *clocks.begin();
    if (clocks.size() > 1) {
      warnings->push_back(
          "no process measured its clock against a reference, and the processes ran on different hosts: their "
          "times are not aligned");
    }
  }
  return reference;
}

// Each process's offset onto the reference clock, with its row of the report.
std::vector<int64_t> AlignClocks(const std::vector<ProcessTrace>& procs, const std::string& reference,
                                 TraceMergeReport& report) {
  // The reference's own trace (the coordinator's, when it was traced): a
  // process on the reference clock that measured no other.
  const ProcessTrace* reference_trace = nullptr;
  for (const auto& p : procs) {
    if (p.Info("clock") == reference && p.clock.empty() &&
        (reference_trace == nullptr || p.Info("role") == "coordinator")) {
      reference_trace = &p;
    }
  }
  std::vector<int64_t> offsets(procs.size(), 0);
  for (size_t i = 0; i < procs.size(); ++i) {
    const ProcessTrace& p = procs[i];
    TraceMergeReport::Process rp;
    rp.file = p.file;
    rp.name = p.Info("name");
    rp.role = p.Info("role");
    rp.events = p.events.size();
    const int64_t own_skew = p.InfoInt("clock_skew_ns", 0);
    const int64_t reference_skew = reference_trace != nullptr ? reference_trace->InfoInt("clock_skew_ns", 0) : 0;
    const bool same_host = p.Info("clock") == reference;
    if (same_host && own_skew == reference_skew && (reference_trace != nullptr || p.clock.empty())) {
      // The reference's host: the same CLOCK_MONOTONIC, so the offset is
      // 0, exactly, without a round trip. (A skew injected into one of them,
      // failpoint trace.clock_skew_ms, makes it another machine's clock.)
      rp.aligned = rp.same_clock = true;
    } else if (auto it = p.clock.find(reference); it != p.clock.end()) {
      const trace::OffsetEstimate est = trace::EstimateOffset(it->second);
      rp.samples = est.samples;
      rp.delay_ns = est.delay_ns;
      rp.offset_ns = est.offset_ns;
      rp.aligned = est.samples > 0;
    }
    if (!rp.aligned && same_host) {  // no round trip, but the host's clock and the skews both traces carry
      rp.offset_ns = reference_skew - own_skew;
      rp.aligned = rp.same_clock = true;
    }
    if (!rp.aligned) {
      report.warnings.push_back(
          fmt::format("{}: no round trip to the reference clock, and another host's clock: not aligned", p.file));
    }
    offsets[i] = rp.offset_ns;
    report.events += p.events.size();
    report.processes.push_back(std::move(rp));
  }
  return offsets;
}

// Each process's track (in `order`): its name, threads, spans and instants.
void EmitTracks(const std::vector<ProcessTrace>& procs, const std::vector<size_t>& order,
                const std::vector<int64_t>& offsets, int64_t origin, const Emit& emit) {
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    const ProcessTrace& p = procs[i];
    const int pid = static_cast<int>(i) + 1;
    std::string label = p.Info("name");
    if (p.Info("role") == "worker" && p.rank >= 0) label += fmt::format(" (rank {})", p.rank);
    if (p.Info("role") == "server" && p.rank >= 0) label += fmt::format(" (server {})", p.rank);
    if (!p.Info("node").empty()) label += fmt::format(" on {}", p.Info("node"));
    label += fmt::format(" pid {}", p.InfoInt("pid", 0));
    emit(fmt::format(R"({{"ph":"M","pid":{},"name":"process_name","args":{{"name":{}}}}})", pid, JsonQuote(label)));
    emit(fmt::format(R"({{"ph":"M","pid":{},"name":"process_sort_index","args":{{"sort_index":{}}}}})", pid, k));
    std::set<int64_t> tids;
    for (const auto& e : p.events) tids.insert(e.tid);
    for (int64_t tid : tids) {
      auto it = p.threads.find(tid);
      std::string name = it != p.threads.end() && !it->second.empty() ? it->second : fmt::format("thread {}", tid);
      emit(fmt::format(R"({{"ph":"M","pid":{},"tid":{},"name":"thread_name","args":{{"name":{}}}}})", pid,
                       TrackTid(tid), JsonQuote(name)));
      emit(fmt::format(R"({{"ph":"M","pid":{},"tid":{},"name":"thread_sort_index","args":{{"sort_index":{}}}}})", pid,
                       TrackTid(tid), tid < 0 ? 100 - tid : ThreadOrder(name)));
    }
    for (const auto& e : p.events) {
      const int64_t ts = e.ts + offsets[i] - origin;
      const std::string cat = e.json.Str("cat");
      if (e.ph == 'X') {
        emit(fmt::format(R"({{"ph":"X","pid":{},"tid":{},"name":{},"cat":{},"ts":{},"dur":{},"args":{}}})", pid,
                         TrackTid(e.tid), JsonQuote(e.name), JsonQuote(cat), Us(ts), Us(e.dur), ArgsJson(e)));
      } else {
        emit(fmt::format(R"({{"ph":"i","s":"{}","pid":{},"tid":{},"name":{},"cat":{},"ts":{},"args":{}}})",
                         cat == "membership" ? 'p' : 't', pid, TrackTid(e.tid), JsonQuote(e.name), JsonQuote(cat),
                         Us(ts), ArgsJson(e)));
      }
    }
  }
}

// Flows: a worker's push -> the server taking it in -> the server's update
// of that partition and step; the server taking it in -> the worker getting
// the acknowledgement; a pull -> the server receiving it -> its answer -> the
// worker getting the parameters. Counts the pushes and links in `report`.
void EmitFlows(const std::vector<ProcessTrace>& procs, const std::vector<int64_t>& offsets, int64_t origin,
               const Emit& emit, TraceMergeReport& report) {
  struct Where {
    int pid;
    int64_t tid;
    int64_t ts;
  };
  std::unordered_map<int64_t, Where> server_push, pull_recv, pull_answer, push_reply, pull_reply;
  std::map<std::tuple<int, int64_t, uint64_t>, Where> updates;  // (pid, partition, step)
  for (size_t i = 0; i < procs.size(); ++i) {
    const int pid = static_cast<int>(i) + 1;
    const bool server = procs[i].Info("role") == "server";
    for (const auto& e : procs[i].events) {
      const Where w{pid, TrackTid(e.tid), e.ts + offsets[i] - origin};
      const int64_t corr = ArgInt(e, "corr", 0);
      if (server && e.name == "push" && corr != 0) server_push[corr] = w;
      if (server && e.name == "pull_recv" && corr != 0) pull_recv[corr] = w;
      if (server && e.name == "pull_answer" && corr != 0) pull_answer[corr] = w;
      if (server && e.name == "update" && ArgInt(e, "backup", 0) == 0) {
        updates.emplace(std::make_tuple(pid, ArgInt(e, "partition"), e.step), w);
      }
      if (!server && e.name == "push_reply" && corr != 0) push_reply[corr] = w;
      if (!server && e.name == "pull_reply" && corr != 0) pull_reply[corr] = w;
    }
  }
  uint64_t flow_id = 0;
  const auto flow = [&](const char* name, const std::vector<Where>& chain) {
    ++flow_id;
    for (size_t n = 0; n < chain.size(); ++n) {
      const char ph = n == 0 ? 's' : (n + 1 == chain.size() ? 'f' : 't');
      emit(fmt::format(R"({{"ph":"{}","id":{},"pid":{},"tid":{},"ts":{},"name":"{}","cat":"flow"{}}})", ph, flow_id,
                       chain[n].pid, chain[n].tid, Us(chain[n].ts), name, ph == 'f' ? R"(,"bp":"e")" : ""));
    }
  };
  for (size_t i = 0; i < procs.size(); ++i) {
    if (procs[i].Info("role") == "server") continue;
    const int pid = static_cast<int>(i) + 1;
    for (const auto& e : procs[i].events) {
      const int64_t corr = ArgInt(e, "corr", 0);
      if (corr == 0 || e.ph != 'X') continue;
      const Where here{pid, TrackTid(e.tid), e.ts + offsets[i] - origin};
      if (e.name == "push") {
        ++report.pushes;
        auto got = server_push.find(corr);
        if (got == server_push.end()) continue;
        std::vector<Where> chain = {here, got->second};
        if (auto u = updates.find(std::make_tuple(got->second.pid, ArgInt(e, "partition"), e.step));
            u != updates.end()) {
          chain.push_back(u->second);
          ++report.pushes_linked;
        }
        flow(chain.size() == 3 ? "push -> update" : "push", chain);
        if (auto r = push_reply.find(corr); r != push_reply.end()) flow("push acknowledged", {got->second, r->second});
      } else if (e.name == "pull") {
        std::vector<Where> chain = {here};
        if (auto r = pull_recv.find(corr); r != pull_recv.end()) chain.push_back(r->second);
        if (auto a = pull_answer.find(corr); a != pull_answer.end()) chain.push_back(a->second);
        if (auto r = pull_reply.find(corr); r != pull_reply.end()) chain.push_back(r->second);
        if (chain.size() == 4) ++report.pulls_linked;
        if (chain.size() > 1) flow("pull -> answer", chain);
      }
    }
  }
}

// Each traced worker's steps, split into what their time went to (the SVG's rows).
std::vector<std::pair<std::string, std::map<uint64_t, Breakdown>>> StepRows(const std::vector<ProcessTrace>& procs,
                                                                            const std::vector<size_t>& order) {
  std::vector<std::pair<std::string, std::map<uint64_t, Breakdown>>> rows;
  for (size_t i : order) {
    const ProcessTrace& p = procs[i];
    if (p.Info("role") != "worker") continue;
    std::map<uint64_t, Breakdown> steps;
    for (const auto& e : p.events) {
      if (e.ph != 'X' || e.step == 0) continue;
      const double s = static_cast<double>(e.dur) * 1e-9;
      Breakdown& b = steps[e.step];
      if (e.name == "step")
        b.step += s;
      else if (e.name == "forward" || e.name == "backward")
        b.compute += s;
      else if (e.name == "param_wait") {  // inside a forward: waiting, not computing
        b.compute -= s;
        b.wait += s;
      } else if (e.name == "end_step_wait")
        b.wait += s;
      else if (e.name == "reduce_scatter")
        b.reduce_scatter += s;
      else if (e.name == "push" || e.name == "push_wait")
        b.push += s;
      else if (e.name == "pull_wait")
        b.pull += s;
      else if (e.name == "all_gather" || e.name == "gather")
        b.all_gather += s;
      else if (e.name == "allreduce" || e.name == "loss_allreduce")
        b.other += s;
    }
    std::erase_if(steps, [](const auto& kv) { return kv.second.step <= 0; });
    if (steps.empty()) continue;
    std::string label = p.Info("name");
    if (p.rank >= 0) label = fmt::format("rank {} ({})", p.rank, label);
    rows.emplace_back(label, std::move(steps));
  }
  return rows;
}

}  // namespace

Result<TraceMergeReport> MergeTraces(const TraceMergeOptions& options) {
  namespace fs = std::filesystem;
  TraceMergeReport report;
  std::error_code ec;
  if (!fs::is_directory(options.dir, ec)) return NotFound("trace directory '{}' does not exist", options.dir);
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(options.dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 12 && name.ends_with(".trace.jsonl")) files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    return NotFound("no trace files (*.trace.jsonl) in '{}': was the run started with --trace {}?", options.dir,
                    options.dir);
  }
  std::vector<ProcessTrace> procs;
  for (const auto& f : files) {
    TANDEM_ASSIGN_OR_RETURN(ProcessTrace p, ReadTrace(f, &report.warnings));
    procs.push_back(std::move(p));
  }
  report.reference = ChooseReference(procs, &report.warnings);
  const std::vector<int64_t> offsets = AlignClocks(procs, report.reference, report);
  // Times: on the reference clock, from the earliest event.
  int64_t origin = INT64_MAX;
  for (size_t i = 0; i < procs.size(); ++i) {
    for (const auto& e : procs[i].events) origin = std::min(origin, e.ts + offsets[i]);
  }
  if (origin == INT64_MAX) origin = 0;
  // Track order: by role and rank; pids are positions (real pids may repeat across hosts).
  std::vector<size_t> order(procs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return SortKey(procs[a]) < SortKey(procs[b]); });
  std::ofstream out(options.output, std::ios::trunc);
  if (!out) return Unavailable("cannot write '{}': {}", options.output, std::strerror(errno));
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first_line = true;
  const auto emit = [&](const std::string& line) {
    if (!first_line) out << ",\n";
    first_line = false;
    out << line;
  };
  EmitTracks(procs, order, offsets, origin, emit);
  EmitFlows(procs, offsets, origin, emit, report);
  out << "\n],\"otherData\":{\"generator\":\"tandem trace merge\",\"reference_clock\":" << JsonQuote(report.reference)
      << ",\"processes\":[";
  for (size_t i = 0; i < report.processes.size(); ++i) {
    const auto& rp = report.processes[i];
    out << (i ? "," : "")
        << fmt::format(R"({{"file":{},"offset_ns":{},"delay_ns":{},"samples":{},"aligned":{}}})", JsonQuote(rp.file),
                       rp.offset_ns, rp.delay_ns, rp.samples, rp.aligned);
  }
  out << "]}}\n";
  if (!out.flush()) return Unavailable("cannot write '{}'", options.output);

  if (!options.svg.empty()) {
    const auto rows = StepRows(procs, order);
    const std::string svg = Svg(rows);
    if (svg.empty()) {
      report.warnings.push_back("no worker step was traced: no step breakdown to draw");
    } else {
      std::ofstream f(options.svg, std::ios::trunc);
      if (!(f << svg) || !f.flush()) return Unavailable("cannot write '{}'", options.svg);
    }
  }
  return report;
}

int TraceCommand(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "merge") != 0) {
    const bool help = argc >= 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0);
    fmt::print(help ? stdout : stderr,
               "tandem trace: name a subcommand: merge (tandem trace merge DIR -o trace.json; it takes --help)\n");
    return help ? 0 : 2;
  }
  TraceMergeOptions o;
  OptionSet options("tandem trace merge",
                    "join the per-process trace files of a traced run (tandem run --trace DIR, or trace.dir) into one "
                    "Chrome trace-event file for Perfetto (ui.perfetto.dev) or chrome://tracing, every process on "
                    "the coordinator's clock (offsets from round trips), flows linking each push to its server's "
                    "update and each pull to its answer");
  options.Positional("DIR", &o.dir, "the trace directory", true);
  o.output = "trace.json";
  options.String("output", &o.output, "the merged trace-event JSON file (-o)");
  options.String("svg", &o.svg,
                 "also draw each worker's step breakdown (compute, exposed wait, reduce-scatter, "
                 "push, pull, all-gather per rank and step) into this SVG file");
  // -o FILE as a short form of --output.
  std::vector<std::string> args(argv + 1, argv + argc);
  for (auto& a : args) {
    if (a == "-o") a = "--output";
  }
  std::vector<char*> av;
  for (auto& a : args) av.push_back(a.data());
  av.push_back(nullptr);
  if (int rc = ParseOrExit(options, static_cast<int>(args.size()), av.data()); rc >= 0) return rc;
  auto merged = MergeTraces(o);
  if (!merged.ok()) {
    fmt::print(stderr, "tandem trace merge: {}\n", merged.status().message());
    return 1;
  }
  for (const auto& w : merged->warnings) fmt::print(stderr, "warning: {}\n", w);
  fmt::print("{} processes, {} events -> {}\n", merged->processes.size(), merged->events, o.output);
  for (const auto& p : merged->processes) {
    const std::string how = p.same_clock    ? std::string("the reference's clock")
                            : p.samples > 0 ? fmt::format("round trip {:.3f} ms, {} samples",
                                                          static_cast<double>(p.delay_ns) * 1e-6, p.samples)
                                            : std::string("NOT ALIGNED");
    fmt::print("  {:<32} {:<11} offset {:>+10.3f} ms ({})\n", p.file, p.role, static_cast<double>(p.offset_ns) * 1e-6,
               how);
  }
  fmt::print("pushes linked to their update: {} of {}; pulls linked to their answer: {}\n", merged->pushes_linked,
             merged->pushes, merged->pulls_linked);
  if (!o.svg.empty()) fmt::print("step breakdown: {}\n", o.svg);
  fmt::print("open {} in https://ui.perfetto.dev or chrome://tracing\n", o.output);
  return 0;
}

}  // namespace tandem::cli
