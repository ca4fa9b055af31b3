#include "worker/comm/factory.h"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

namespace tandem::comm {

std::vector<std::string> BackendNames() {
  return {"shm", "ucx"};
}

namespace {

Result<std::unique_ptr<Communicator>> CreateUcx(const CommInfo& info, Rendezvous& rendezvous,
                                                const BackendOptions& options) {
  TANDEM_ASSIGN_OR_RETURN(auto transport, transport::UcxTransport::Create(options.ucx));
  const std::string prefix = fmt::format("ucx/{}/{}/", info.name, info.epoch);
  TANDEM_RETURN_IF_ERROR(rendezvous.Put(prefix + std::to_string(info.rank), transport->address())
                             .WithContext("publishing this rank's UCX address"));
  std::vector<std::string> addresses(static_cast<size_t>(info.size));
  const auto deadline = std::chrono::steady_clock::now() + info.timeout;
  for (int r = 0; r < info.size; ++r) {
    if (r == info.rank) {
      addresses[static_cast<size_t>(r)] = transport->address();
      continue;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    auto address = rendezvous.Get(prefix + std::to_string(r), std::max(left, std::chrono::milliseconds(1)));
    if (!address.ok()) {
      return address.status().WithContext(
          fmt::format("communicator \"{}\" (epoch {}): waiting for rank {}'s UCX address", info.name, info.epoch, r));
    }
    addresses[static_cast<size_t>(r)] = *address;
  }
  TANDEM_RETURN_IF_ERROR(
      transport
          ->Connect(info.rank, info.size, addresses, info.timeout, [&rendezvous] { return rendezvous.cancelled(); })
          .WithContext(fmt::format("communicator \"{}\" (epoch {})", info.name, info.epoch)));
  TransportCommunicatorOptions transport_options = options.transport;
  transport_options.backend = "ucx";
  TANDEM_ASSIGN_OR_RETURN(auto communicator,
                          TransportCommunicator::Create(info, std::move(transport), transport_options));
  return std::unique_ptr<Communicator>(std::move(communicator));
}

}  // namespace

Result<std::unique_ptr<Communicator>> CreateCommunicator(const std::string& backend, const CommInfo& info,
                                                         Rendezvous& rendezvous, const BackendOptions& options) {
  if (backend == "shm") {
    TANDEM_ASSIGN_OR_RETURN(auto shm, ShmCommunicator::Create(info, rendezvous, options.shm));
    return std::unique_ptr<Communicator>(std::move(shm));
  }
  if (backend == "ucx") return CreateUcx(info, rendezvous, options);
  std::string known;
  for (const auto& name : BackendNames()) known += (known.empty() ? "" : ", ") + name;
  return InvalidArgument("unknown communicator backend \"{}\" (this build offers: {})", backend, known);
}

}  // namespace tandem::comm
