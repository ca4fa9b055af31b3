// ParameterStore, pulls: answering them once their step is applied and
// safe, with weights lent to the reply instead of copied.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include <google/protobuf/util/message_differencer.h>
#include <spdlog/spdlog.h>

#include "common/crc32c.h"
#include "common/failpoint.h"
#include "common/optimizer/gradient.h"
#include "common/trace.h"
#include "server/checkpoint/checkpoint.h"
#include "server/ps_core.h"
#include "server/ps_core_internal.h"

namespace tandem::server {

using namespace store_internal;  // NOLINT(google-build-using-namespace)

void ParameterStore::UnlendLocked(Part& part, bool keep_values) {
  if (!part.lent) return;
  // Acquire: pairs with a reply's release when it is done reading, so the
  // writes that follow come after its reads.
  if (part.lent->readers.load(std::memory_order_acquire) > 0) {
    part.lent->buffer = std::move(part.state.weights);
    part.state.weights.clear();
    if (keep_values) part.state.weights = part.lent->buffer;
  }
  part.lent.reset();
}

void ParameterStore::AnswerPullLocked(Part& part, const PendingPull& pull, Actions& actions) {
  const size_t n = part.state.size();
  const v1::WireDType dtype = Wire(pull.header.dtype);
  ReplyBody body;
  if (Fp32Wire(pull.header.dtype)) {
    // Sent from the weights themselves: no copy. The next update finds the
    // buffer lent and, if a reply still reads it, works on a copy.
    if (!part.lent) part.lent = std::make_shared<Lent>();
    part.lent->readers.fetch_add(1, std::memory_order_relaxed);
    body.borrowed = part.state.weights.data();
    body.borrowed_bytes = n * sizeof(float);
    body.keep = std::shared_ptr<const void>(
        part.lent.get(), [lent = part.lent](const void*) { lent->readers.fetch_sub(1, std::memory_order_release); });
  } else {
    body.owned.resize(WireBytes(dtype, n));
    EncodeWire(body.owned.data(), part.state.weights.data(), dtype, n);
  }
  if (const uint64_t corr = ps::Correlation(pull.header); corr != 0 && trace::On()) {
    // The pull's answer (the puller traces its step): links to its request.
    const int64_t now = trace::Now();
    trace::Complete("pull_answer", "ps", now, now, pull.header.step,
                    {{"partition", part.state.id},
                     {"corr", static_cast<int64_t>(corr)},
                     {"version", static_cast<int64_t>(part.state.version)},
                     {"bytes", static_cast<int64_t>(body.size())}});
  }
  ps::Frame reply = ps::ReplyTo(pull.header, ps::FrameType::kPullReply);
  reply.dtype = pull.header.dtype;
  reply.step = part.state.step;
  reply.version = part.state.version;
  reply.payload_bytes = body.size();
  part.bytes_pulled += body.size();
  part.pulls_served++;
  counters_.pull_bytes.fetch_add(body.size());
  actions.push_back([r = pull.reply, reply, body = std::move(body)]() mutable { r(reply, std::move(body)); });
}

void ParameterStore::ServePullsLocked(Part& part, Actions& actions) {
  // Deferred push acknowledgements (async modes): once the update is safe.
  for (auto it = part.push_acks.begin(); it != part.push_acks.end();) {
    if (part.safe_step >= it->first) {
      actions.push_back([r = std::move(it->second)]() mutable { r(ps::Frame{}, {}); });
      it = part.push_acks.erase(it);
    } else {
      ++it;
    }
  }
  if (part.pulls.empty()) return;
  uint64_t slowest = 0;
  const bool bounded = mode_.load() == v1::CONSISTENCY_MODE_BOUNDED_STALENESS;
  const uint32_t bound = bound_.load();
  if (bounded && !part.clocks.empty()) slowest = *std::min_element(part.clocks.begin(), part.clocks.end());
  for (auto it = part.pulls.begin(); it != part.pulls.end();) {
    bool ready = part.safe_step >= it->target && part.state.step >= it->target && part.safe_step >= part.state.step;
    if (bounded && !part.clocks.empty() && it->header.step > slowest + bound + 1) ready = false;
    if (ready) {
      AnswerPullLocked(part, *it, actions);
      it = part.pulls.erase(it);
    } else {
      ++it;
    }
  }
}

void ParameterStore::Pull(uint64_t from, const ps::Frame& h, Reply reply) {
  auto refuse = [&](const Status& status) {
    counters_.pulls.fetch_add(1);
    std::vector<char> body;
    ps::Frame r = Refusal(h, status, &body);
    reply(r, std::move(body));
  };
  auto checked = CheckDataFrame(h, /*primary=*/true);
  if (!checked.ok()) return refuse(checked.status());
  if (h.dtype != v1::WIRE_DTYPE_UNSPECIFIED && h.dtype != v1::WIRE_DTYPE_FP32 && h.dtype != v1::WIRE_DTYPE_BF16) {
    return refuse(InvalidArgument("dtype {}: pulls return FP32 or BF16", h.dtype));
  }
  bool sync;
  uint64_t start_step;
  {
    MutexLock lock(&mu_);
    sync = IsSync(consistency_);
    start_step = start_step_;
  }
  std::shared_ptr<Part> part = *checked;
  if (const uint64_t corr = ps::Correlation(h); corr != 0 && trace::On()) {
    const int64_t now = trace::Now();
    trace::Complete("pull_recv", "ps", now, now, h.step,
                    {{"partition", h.partition}, {"corr", static_cast<int64_t>(corr)}});
  }
  Actions actions;
  {
    MutexLock plock(&part->mu);
    counters_.pulls.fetch_add(1);
    PendingPull pull{from, h, 0, std::move(reply)};
    bool refused = false;
    auto refuse_pull = [&](const Status& status) {
      std::vector<char> body;
      ps::Frame r = Refusal(h, status, &body);
      actions.push_back(
          [rep = std::move(pull.reply), r, body = std::move(body)]() mutable { rep(r, std::move(body)); });
      refused = true;
    };
    if (h.epoch != part->epoch) {
      refuse_pull(Superseded(h.epoch, part->epoch));
    } else if (sync) {
      if (h.step > part->state.step + 1) {
        // It could only be reached after a step this puller has not pushed.
        refuse_pull(FailedPrecondition("step {} is from the future: partition {} has completed step {}, the next is {}",
                                       h.step, h.partition, part->state.step, part->state.step + 1));
      }
      pull.target = h.step;
    } else {
      pull.target = part->state.step;
      if (h.contributors > 0 && h.contributors <= kMaxContributors) {
        // The contributor is checked first: a refused pull starts no clocks
        // (which would fix the epoch's contributor count).
        if (h.contributor >= h.contributors) {
          refuse_pull(InvalidArgument("contributor {} is not below contributors ({})", h.contributor, h.contributors));
        } else {
          if (part->clocks.empty()) part->clocks.assign(h.contributors, start_step);
          if (part->clocks.size() != h.contributors) {
            refuse_pull(InvalidArgument("contributors: this pull says {}, the pushes and pulls of this epoch said {}",
                                        h.contributors, part->clocks.size()));
          } else if (h.step > 0) {
            // The puller computes step h.step next: it is done with the
            // steps before (pushed, or left behind by a membership change
            // after which the workers go on from a later step than the
            // epoch's start_step), and pushes of them are duplicates from
            // now on.
            part->clocks[h.contributor] = std::max(part->clocks[h.contributor], h.step - 1);
          }
        }
      }
    }
    if (!refused) {
      part->pulls.push_back(std::move(pull));
      ServePullsLocked(*part, actions);
    }
  }
  Run(actions);
}

}  // namespace tandem::server
