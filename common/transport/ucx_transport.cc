// UcxTransport's public face: each call goes to its Core
// (common/transport/ucx/core.h, whose header lists where each part lives).
#include "common/transport/ucx_transport.h"

#include "common/transport/ucx/core.h"

namespace tandem::transport {

using ucx::Core;
using ucx::Op;

Result<std::unique_ptr<UcxTransport>> UcxTransport::Create(const UcxOptions& options) {
  auto core = std::make_shared<Core>(options);
  TANDEM_RETURN_IF_ERROR(core->Init());
  core->Start();
  return std::unique_ptr<UcxTransport>(new UcxTransport(std::move(core)));
}

UcxTransport::~UcxTransport() {
  core_->Shutdown();
}

std::string UcxTransport::address() const {
  return core_->Address();
}

Status UcxTransport::Connect(int rank, int size, const std::vector<std::string>& peer_addresses,
                             std::chrono::milliseconds timeout, std::function<bool()> cancelled) {
  return core_->Connect(rank, size, peer_addresses, timeout, cancelled);
}

std::vector<std::string> UcxTransport::PathSummary() const {
  return core_->PathSummary();
}

int UcxTransport::rank() const {
  return core_->Rank();
}
int UcxTransport::size() const {
  return core_->Size();
}

std::unique_ptr<Request> UcxTransport::Send(int peer, uint64_t tag, const void* data, size_t bytes) {
  return core_->Submit(Op::Kind::kSend, peer, tag, false, const_cast<void*>(data), bytes);
}

std::unique_ptr<Request> UcxTransport::Recv(int peer, uint64_t tag, void* data, size_t bytes) {
  return core_->Submit(Op::Kind::kRecv, peer, tag, false, data, bytes);
}

std::unique_ptr<Request> UcxTransport::SendAsync(int peer, uint64_t tag, const void* data, size_t bytes,
                                                 Completion done) {
  return core_->Submit(Op::Kind::kSend, peer, tag, false, const_cast<void*>(data), bytes, std::move(done));
}

std::unique_ptr<Request> UcxTransport::RecvAsync(int peer, uint64_t tag, void* data, size_t bytes, Completion done) {
  return core_->Submit(Op::Kind::kRecv, peer, tag, false, data, bytes, std::move(done));
}

void UcxTransport::WaitPosted() {
  core_->WaitPosted();
}

Transport::Progressed UcxTransport::Progress() {
  return core_->Progress();
}

}  // namespace tandem::transport
