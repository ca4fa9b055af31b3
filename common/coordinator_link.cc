#include "common/coordinator_link.h"

#include <spdlog/spdlog.h>

namespace tandem {

void DeclareCoordinatorLinkOptions(OptionSet& options, CoordinatorLinkConfig* config) {
  options.Address("coordinator.address", &config->address, "the coordinator's gRPC address");
  options.Duration("coordinator.check_interval", &config->check_interval,
                   "how often the coordinator's health is checked", std::chrono::milliseconds(50),
                   std::chrono::milliseconds(60000));
}

Result<std::unique_ptr<CoordinatorLink>> CoordinatorLink::Start(const CoordinatorLinkConfig& config, Daemon& daemon) {
  std::unique_ptr<CoordinatorLink> link(new CoordinatorLink());
  TANDEM_ASSIGN_OR_RETURN(link->channel_,
                          MakeChannel(config.address, daemon.config().tls, daemon.config().max_message_bytes));
  auto& up = prometheus::BuildGauge()
                 .Name("tandem_coordinator_reachable")
                 .Help("1 while this process's coordinator answers its health checks as SERVING, else 0.")
                 .Register(daemon.registry())
                 .Add({});
  auto& changes = prometheus::BuildCounter()
                      .Name("tandem_coordinator_reachability_changes_total")
                      .Help("Times the coordinator went from reachable to unreachable or back.")
                      .Register(daemon.registry())
                      .Add({});
  const std::string address = config.address;
  Daemon* d = &daemon;  // outlives the link (see Start's contract)
  link->watcher_ = std::make_unique<HealthWatcher>(
      link->channel_, config.check_interval,
      [address, d, &up, &changes, first = true](bool serving, const std::string& detail) mutable {
        if (serving) {
          spdlog::info("coordinator at {} is serving", address);
        } else {
          spdlog::warn("coordinator at {} is not reachable ({}); waiting for it", address, detail);
        }
        if (!first) changes.Increment();
        first = false;
        up.Set(serving ? 1 : 0);
        d->SetReady(serving);
      });
  return link;
}

}  // namespace tandem
