// ParameterStore: construction and what every phase uses (replies,
// refusals, finding a partition). The phases are in ps_membership.cc,
// ps_job.cc, ps_aggregation.cc, ps_replication.cc, ps_pull.cc and
// ps_capture.cc.
#include "server/ps_core.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include <google/protobuf/util/message_differencer.h>
#include <spdlog/spdlog.h>

#include "common/crc32c.h"
#include "common/failpoint.h"
#include "common/optimizer/gradient.h"
#include "server/checkpoint/checkpoint.h"
#include "server/ps_core_internal.h"

namespace tandem::server {

using namespace store_internal;  // NOLINT(google-build-using-namespace)

ParameterStore::ParameterStore(StoreOptions options, ServerLinks* links) : options_(options), links_(links) {
  int threads = options_.threads > 0 ? options_.threads : static_cast<int>(std::thread::hardware_concurrency());
  pool_ = std::make_unique<ThreadPool>(std::max(1, threads));
}

ParameterStore::~ParameterStore() = default;

uint64_t ParameterStore::Fingerprint(const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors) {
  return TensorTableFingerprint(tensors);
}

std::vector<char> ReplyBody::Take() && {
  if (borrowed == nullptr) return std::move(owned);
  const char* bytes = static_cast<const char*>(borrowed);
  return std::vector<char>(bytes, bytes + borrowed_bytes);
}

void ParameterStore::Run(Actions& actions) {
  for (auto& action : actions) action();
  actions.clear();
}

ps::Frame ParameterStore::Refusal(const ps::Frame& request, const Status& status, std::vector<char>* payload) {
  const bool push = request.type == ps::FrameType::kPush;
  return ErrorReply(request, push ? ps::FrameType::kPushReply : ps::FrameType::kPullReply,
                    status.WithContext(fmt::format("{} of partition {} step {}", push ? "push" : "pull",
                                                   request.partition, request.step)),
                    payload);
}

ps::Frame ParameterStore::ErrorReply(const ps::Frame& request, ps::FrameType type, const Status& status,
                                     std::vector<char>* payload) {
  ps::Frame reply = ps::ReplyTo(request, type);
  *payload = ps::ErrorPayload(reply, status);
  return reply;
}

std::shared_ptr<ParameterStore::Part> ParameterStore::Find(uint32_t partition) const {
  MutexLock lock(&mu_);
  auto it = parts_.find(partition);
  return it == parts_.end() ? nullptr : it->second;
}

uint64_t ParameterStore::epoch() const {
  MutexLock lock(&mu_);
  return epoch_;
}

bool ParameterStore::configured() const {
  MutexLock lock(&mu_);
  return configured_;
}

}  // namespace tandem::server
