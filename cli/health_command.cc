// tandem health ADDRESS [--service NAME] [--timeout DURATION] [TLS flags]
//
// Prints the serving status of a daemon's gRPC health service and exits 0
// when it is SERVING, 1 otherwise (unreachable, NOT_SERVING, unknown service),
// 2 on bad arguments. Usable as a Kubernetes exec probe.
#include "cli/commands.h"
#include "common/grpc_util.h"
#include "common/health.h"

namespace tandem::cli {

int HealthCommand(int argc, char** argv) {
  std::string address;
  std::string service;
  std::chrono::milliseconds timeout{2000};
  TlsConfig tls;
  OptionSet options("tandem health", "ask a Tandem daemon's gRPC health service whether it is serving");
  options.Positional("ADDRESS", &address, "the daemon's gRPC address, HOST:PORT", true);
  options.String("service", &service,
                 "service to ask about: empty for the process (liveness), tandem.ready for readiness");
  options.Duration("timeout", &timeout, "how long to wait for an answer", std::chrono::milliseconds(1),
                   std::chrono::milliseconds(600000));
  DeclareTlsOptions(options, &tls, /*client_only=*/true);
  if (int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  if (auto hp = ParseHostPort(address); !hp.ok()) {
    fmt::print(stderr, "tandem health: ADDRESS: {}\n", hp.status().message());
    return 2;
  }
  auto channel = MakeChannel(address, tls);
  if (!channel.ok()) {
    fmt::print(stderr, "tandem health: {}\n", channel.status().message());
    return 2;
  }
  auto state = CheckHealth(*channel, service, timeout);
  if (!state.ok()) {
    fmt::print("{}: unreachable: {}\n", address, state.status().message());
    return 1;
  }
  fmt::print("{}{}: {}\n", address, service.empty() ? "" : " (" + service + ")", *state);
  return *state == "SERVING" ? 0 : 1;
}

}  // namespace tandem::cli
