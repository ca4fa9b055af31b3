#include "common/trace.h"

#include <pthread.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "common/config.h"
#include "common/failpoint.h"
#include "common/json.h"

namespace tandem::trace {

namespace internal {
std::atomic<bool> on{false};
std::atomic<uint64_t> first_step{0};
std::atomic<uint64_t> last_step{UINT64_MAX};
std::atomic<int64_t> skew_ns{0};
}  // namespace internal

namespace {

struct Event {
  const char* name = nullptr;
  const char* cat = nullptr;
  int64_t ts = 0;
  int64_t dur = -1;  // -1: an instant
  uint64_t step = 0;
  Arg args[kMaxArgs] = {};
  uint8_t nargs = 0;
  const char* text_key = nullptr;
  char text[32] = {};
  const char* track_kind = nullptr;  // null: the thread's
  int64_t track = 0;
};

// Bounds what a thread buffers between two drains (200 ms); beyond it events
// are dropped and counted.
constexpr size_t kMaxBuffered = size_t{1} << 17;

struct ThreadBuffer {
  std::mutex mu;
  std::vector<Event> events;  // guarded by mu
  int tid = 0;
  std::string name;  // guarded by mu
  bool name_pending = false;
};

struct Recorder {
  std::mutex mu;  // the fields below
  std::condition_variable cv;
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  std::vector<std::string> lines;  // process info and clock samples, in order
  std::FILE* file = nullptr;
  std::string path;
  std::thread writer;
  bool quit = false;
  uint64_t written = 0;
  std::atomic<uint64_t> dropped{0};
  std::atomic<uint64_t> generation{1};
  std::mutex write_mu;                                        // one drain at a time; guards tracks
  std::map<std::pair<std::string, int64_t>, int64_t> tracks;  // (kind, index) -> tid
};

Recorder& R() {
  static auto* r = new Recorder();
  return *r;
}

struct Local {
  uint64_t generation = 0;
  std::shared_ptr<ThreadBuffer> buffer;
};
thread_local Local local;

ThreadBuffer& Mine() {
  Recorder& r = R();
  const uint64_t generation = r.generation.load(std::memory_order_relaxed);
  if (local.generation != generation || local.buffer == nullptr) {
    auto b = std::make_shared<ThreadBuffer>();
    b->tid = static_cast<int>(syscall(SYS_gettid));
    b->events.reserve(256);
    if (local.buffer != nullptr) {
      std::lock_guard<std::mutex> lock(local.buffer->mu);
      b->name = local.buffer->name;
    }
    if (b->name.empty()) {  // the thread's own name (pthread_setname_np), until SetThreadName
      char os_name[16] = {};
      if (pthread_getname_np(pthread_self(), os_name, sizeof(os_name)) == 0) b->name = os_name;
    }
    b->name_pending = !b->name.empty();
    {
      std::lock_guard<std::mutex> lock(r.mu);
      r.buffers.push_back(b);
    }
    local.buffer = std::move(b);
    local.generation = generation;
  }
  return *local.buffer;
}

void Append(const Event& e) {
  ThreadBuffer& b = Mine();
  std::lock_guard<std::mutex> lock(b.mu);
  if (b.events.size() >= kMaxBuffered) {
    R().dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  b.events.push_back(e);
}

Event Make(const char* name, const char* cat, int64_t ts, int64_t dur, uint64_t step, std::initializer_list<Arg> args,
           const char* text_key, std::string_view text) {
  Event e;
  e.name = name;
  e.cat = cat;
  e.ts = ts;
  e.dur = dur;
  e.step = step;
  for (const Arg& a : args) {
    if (e.nargs == kMaxArgs) break;
    e.args[e.nargs++] = a;
  }
  if (text_key != nullptr) {
    e.text_key = text_key;
    const size_t n = std::min(text.size(), sizeof(e.text) - 1);
    std::memcpy(e.text, text.data(), n);
    e.text[n] = '\0';
  }
  return e;
}

// Tracks are negative tids, apart from the threads': one per (kind, index),
// named when first written.
int64_t TrackTid(fmt::memory_buffer& out, const Event& e, std::map<std::pair<std::string, int64_t>, int64_t>& tracks) {
  auto [it, added] = tracks.emplace(std::make_pair(std::string(e.track_kind), e.track), -1 - tracks.size());
  if (added) {
    fmt::format_to(std::back_inserter(out),
                   R"({{"type":"thread","tid":{},"name":"{} {}"}})"
                   "\n",
                   it->second, e.track_kind, e.track);
  }
  return it->second;
}

void FormatEvent(fmt::memory_buffer& out, const Event& e, int64_t tid) {
  fmt::format_to(std::back_inserter(out), R"({{"ph":"{}","name":"{}","cat":"{}","ts":{},)", e.dur < 0 ? 'i' : 'X',
                 e.name, e.cat, e.ts);
  if (e.dur >= 0) fmt::format_to(std::back_inserter(out), R"("dur":{},)", e.dur);
  fmt::format_to(std::back_inserter(out), R"("tid":{},"step":{},"args":{{)", tid, e.step);
  for (int i = 0; i < e.nargs; ++i) {
    fmt::format_to(std::back_inserter(out), R"({}"{}":{})", i == 0 ? "" : ",", e.args[i].key, e.args[i].value);
  }
  if (e.text_key != nullptr) {
    fmt::format_to(std::back_inserter(out), R"({}"{}":{})", e.nargs == 0 ? "" : ",", e.text_key, JsonQuote(e.text));
  }
  out.append(std::string_view("}}\n"));
}

// Writes what every thread buffered, and the pending lines.
void Drain() {
  Recorder& r = R();
  std::lock_guard<std::mutex> write_lock(r.write_mu);
  std::vector<std::string> lines;
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  std::FILE* file = nullptr;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    lines.swap(r.lines);
    buffers = r.buffers;
    file = r.file;
    // A buffer that only this list holds belongs to a thread that ended: the
    // last drain of it is this one.
    std::erase_if(r.buffers, [](const std::shared_ptr<ThreadBuffer>& b) { return b.use_count() == 2; });
  }
  if (file == nullptr) return;
  fmt::memory_buffer out;
  for (const auto& line : lines) {
    out.append(line);
    out.push_back('\n');
  }
  std::vector<Event> events;
  uint64_t n = 0;
  for (const auto& b : buffers) {
    std::string name;
    {
      std::lock_guard<std::mutex> lock(b->mu);
      events.swap(b->events);
      b->events.reserve(std::max<size_t>(256, events.capacity()));
      if (b->name_pending) {
        name = b->name;
        b->name_pending = false;
      }
    }
    if (!name.empty()) {
      fmt::format_to(std::back_inserter(out),
                     R"({{"type":"thread","tid":{},"name":{}}})"
                     "\n",
                     b->tid, JsonQuote(name));
    }
    for (const Event& e : events) FormatEvent(out, e, e.track_kind != nullptr ? TrackTid(out, e, r.tracks) : b->tid);
    n += events.size();
    events.clear();
    if (out.size() > (1 << 20)) {
      std::fwrite(out.data(), 1, out.size(), file);
      out.clear();
    }
  }
  std::fwrite(out.data(), 1, out.size(), file);
  std::fflush(file);
  std::lock_guard<std::mutex> lock(r.mu);
  r.written += n;
}

void AddLine(std::string line) {
  Recorder& r = R();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.file == nullptr) return;
  r.lines.push_back(std::move(line));
}

std::string ReadBootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

std::string HostName() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return host;
}

Status MakeDirs(const std::string& dir) {
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i != dir.size() && dir[i] != '/') continue;
    const std::string prefix = dir.substr(0, i);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return Unavailable("trace.dir: cannot create '{}': {}", prefix, std::strerror(errno));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<StepRange> ParseStepRange(std::string_view text) {
  StepRange range;
  if (text.empty()) return range;
  const auto number = [&](std::string_view s, uint64_t* out) {
    const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
    return ec == std::errc() && p == s.data() + s.size() && !s.empty();
  };
  const size_t colon = text.find(':');
  const auto bad = [&] {
    return InvalidArgument("trace.steps '{}' is not a step range: A:B (steps A to B), A: (from A on), :B or S", text);
  };
  if (colon == std::string_view::npos) {
    if (!number(text, &range.first)) return bad();
    range.last = range.first;
  } else {
    const std::string_view a = text.substr(0, colon), b = text.substr(colon + 1);
    if (!a.empty() && !number(a, &range.first)) return bad();
    if (!b.empty() && !number(b, &range.last)) return bad();
  }
  if (range.first > range.last) {
    return InvalidArgument("trace.steps '{}': the first step {} is after the last {}", text, range.first, range.last);
  }
  return range;
}

void DeclareOptions(OptionSet& options, Config* config) {
  options.String("trace.dir", &config->dir,
                 "write a timeline trace of this process's steps into this directory (one file per process; "
                 "`tandem trace merge DIR` joins them); empty: no tracing");
  options.String("trace.steps", &config->steps,
                 "with trace.dir: the steps traced, A:B (both included), A: (from A on), :B or S (empty: every step)");
  options.AddCheck([config]() -> Status {
    auto range = ParseStepRange(config->steps);
    return range.ok() ? Status::Ok() : range.status();
  });
}

int64_t Now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec +
         internal::skew_ns.load(std::memory_order_relaxed);
}

int64_t FromSteady(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count() +
         internal::skew_ns.load(std::memory_order_relaxed);
}

void SetClockSkewForTesting(int64_t ns) {
  internal::skew_ns.store(ns, std::memory_order_relaxed);
}

const std::string& ClockId() {
  static const std::string id = HostName() + "/" + ReadBootId();
  return id;
}

Status Start(const Config& config, std::string_view role, std::string_view name) {
  if (config.dir.empty()) return Status::Ok();
  TANDEM_ASSIGN_OR_RETURN(const StepRange range, ParseStepRange(config.steps));
  Recorder& r = R();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.file != nullptr) return FailedPrecondition("tracing already writes '{}'", r.path);
  }
  TANDEM_RETURN_IF_ERROR(MakeDirs(config.dir));
  if (auto skew = FailpointValue("trace.clock_skew_ms")) {
    // MS, or NAME:MS for the process named NAME only.
    std::string_view value = *skew;
    bool mine = true;
    if (const size_t colon = value.rfind(':'); colon != std::string_view::npos) {
      mine = value.substr(0, colon) == name;
      value = value.substr(colon + 1);
    }
    int64_t ms = 0;
    const auto [p, ec] = std::from_chars(value.data(), value.data() + value.size(), ms);
    if (ec != std::errc() || p != value.data() + value.size()) {
      spdlog::error("failpoint trace.clock_skew_ms: '{}' is not [NAME:]MILLISECONDS; ignored", *skew);
    } else if (mine) {
      internal::skew_ns = ms * 1'000'000;
      spdlog::warn("failpoint trace.clock_skew_ms: this process's trace clock runs {} ms off", ms);
    }
  }
  const std::string path = fmt::format("{}/{}-{}.trace.jsonl", config.dir, name, getpid());
  std::FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) return Unavailable("trace.dir: cannot create '{}': {}", path, std::strerror(errno));
  const std::string process = fmt::format(
      R"({{"type":"process","version":1,"role":{},"name":{},"pid":{},"host":{},"clock":{},"clock_skew_ns":{},)"
      R"("first_step":{},"last_step":{},"start_ns":{}}})",
      JsonQuote(role), JsonQuote(name), getpid(), JsonQuote(HostName()), JsonQuote(ClockId()), internal::skew_ns.load(),
      range.first, range.last == UINT64_MAX ? -1 : static_cast<int64_t>(range.last), Now());
  {
    std::lock_guard<std::mutex> lock(r.mu);
    r.file = file;
    r.path = path;
    r.lines.clear();
    r.lines.push_back(process);
    r.buffers.clear();
    r.tracks.clear();
    r.written = 0;
    r.dropped = 0;
    r.quit = false;
    r.generation.fetch_add(1);
  }
  internal::first_step = range.first;
  internal::last_step = range.last;
  internal::on.store(true);
  r.writer = std::thread([&r] {
    std::unique_lock<std::mutex> lock(r.mu);
    while (!r.quit) {
      r.cv.wait_for(lock, std::chrono::milliseconds(200));
      if (r.quit) break;
      lock.unlock();
      Drain();
      lock.lock();
    }
  });
  spdlog::info("tracing steps {} into {}", config.steps.empty() ? "all" : config.steps, path);
  return Status::Ok();
}

void Flush() {
  Drain();
}

void Stop() {
  Recorder& r = R();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.file == nullptr) return;
    r.quit = true;
    r.cv.notify_all();
  }
  internal::on.store(false);
  if (r.writer.joinable()) r.writer.join();
  Drain();
  std::lock_guard<std::mutex> write_lock(r.write_mu);
  std::lock_guard<std::mutex> lock(r.mu);
  std::fprintf(r.file,
               R"({"type":"end","events":%llu,"dropped":%llu})"
               "\n",
               static_cast<unsigned long long>(r.written), static_cast<unsigned long long>(r.dropped.load()));
  std::fclose(r.file);
  if (r.dropped > 0) spdlog::warn("tracing dropped {} events (the writer fell behind)", r.dropped.load());
  spdlog::info("trace written: {} ({} events)", r.path, r.written);
  r.file = nullptr;
  r.path.clear();
  r.buffers.clear();
  r.generation.fetch_add(1);
}

std::string Path() {
  Recorder& r = R();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.path;
}

void Complete(const char* name, const char* cat, int64_t start, int64_t end, uint64_t step,
              std::initializer_list<Arg> args, const char* text_key, std::string_view text) {
  if (!On()) return;
  Append(Make(name, cat, start, std::max<int64_t>(0, end - start), step, args, text_key, text));
}

void Instant(const char* name, const char* cat, int64_t ts, uint64_t step, std::initializer_list<Arg> args,
             const char* text_key, std::string_view text) {
  if (!On()) return;
  Append(Make(name, cat, ts, -1, step, args, text_key, text));
}

void Span::End() {
  if (!on_) return;
  on_ = false;
  Event e;
  e.name = name_;
  e.cat = cat_;
  e.ts = start_;
  e.dur = std::max<int64_t>(0, Now() - start_);
  e.step = step_;
  for (int i = 0; i < nargs_; ++i) e.args[i] = args_[i];
  e.nargs = static_cast<uint8_t>(nargs_);
  if (text_key_ != nullptr) {
    e.text_key = text_key_;
    const size_t n = std::min(text_.size(), sizeof(e.text) - 1);
    std::memcpy(e.text, text_.data(), n);
  }
  if (!On()) return;
  Append(e);
}

void SetThreadName(std::string_view name) {
  if (!On()) return;
  ThreadBuffer& b = Mine();
  std::lock_guard<std::mutex> lock(b.mu);
  b.name = std::string(name);
  b.name_pending = true;
}

void CompleteOnTrack(const char* kind, int64_t index, const char* name, const char* cat, int64_t start, int64_t end,
                     uint64_t step, std::initializer_list<Arg> args) {
  if (!On()) return;
  Event e = Make(name, cat, start, std::max<int64_t>(0, end - start), step, args, nullptr, {});
  e.track_kind = kind;
  e.track = index;
  Append(e);
}

namespace {
thread_local uint64_t thread_step = 0;
}  // namespace

void SetThreadStep(uint64_t step) {
  thread_step = step;
}

uint64_t ThreadStep() {
  return thread_step;
}

uint64_t NewCorrelation() {
  static const uint64_t tag = [] {
    const uint64_t mixed = static_cast<uint64_t>(getpid()) * 0x9E3779B97F4A7C15ull ^
                           static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    const uint64_t t = (mixed >> 24) & 0xffff;
    return t == 0 ? uint64_t{1} : t;
  }();
  static std::atomic<uint32_t> counter{0};
  return tag << 32 | (counter.fetch_add(1, std::memory_order_relaxed) + 1u);
}

void SetProcessInfo(std::string_view key, std::string_view value) {
  if (!On()) return;
  AddLine(fmt::format(R"({{"type":"process",{}:{}}})", JsonQuote(key), JsonQuote(value)));
}

void SetProcessInfo(std::string_view key, int64_t value) {
  if (!On()) return;
  AddLine(fmt::format(R"({{"type":"process",{}:{}}})", JsonQuote(key), value));
}

void RecordClockSample(std::string_view ref, int64_t t0, int64_t t1, int64_t t2, int64_t t3) {
  if (!On()) return;
  AddLine(
      fmt::format(R"({{"type":"clock","ref":{},"t0":{},"t1":{},"t2":{},"t3":{}}})", JsonQuote(ref), t0, t1, t2, t3));
}

OffsetEstimate EstimateOffset(const std::vector<ClockSample>& samples) {
  OffsetEstimate best;
  for (const ClockSample& s : samples) {
    const int64_t delay = (s.t3 - s.t0) - (s.t2 - s.t1);
    if (s.t3 < s.t0 || s.t2 < s.t1 || delay < 0) continue;  // not a round trip
    if (best.samples == 0 || delay < best.delay_ns) {
      best.delay_ns = delay;
      // Halves first: no overflow for clocks far apart.
      best.offset_ns = (s.t1 - s.t0) / 2 + (s.t2 - s.t3) / 2;
    }
    ++best.samples;
  }
  return best;
}

}  // namespace tandem::trace
