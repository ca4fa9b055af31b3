#include "common/member_daemon.h"

namespace tandem {

void MakeMemberSpec(DaemonSpec& spec, v1::Role role, std::function<void(OptionSet&)> extra_declare,
                    std::function<Status(Daemon&, v1::NodeIdentity*, MemberHooks*)> extra_started,
                    std::function<void()> extra_stopping) {
  struct State {
    CoordinatorLinkConfig config;
    std::unique_ptr<CoordinatorLink> link;
  };
  auto state = std::make_shared<State>();
  spec.declare = [state, extra_declare](OptionSet& options) {
    DeclareCoordinatorLinkOptions(options, &state->config);
    if (extra_declare) extra_declare(options);
  };
  spec.started = [state, role, extra_started](Daemon& daemon) -> Status {
    v1::NodeIdentity node;
    MemberHooks hooks;
    if (extra_started) TANDEM_RETURN_IF_ERROR(extra_started(daemon, &node, &hooks));
    TANDEM_ASSIGN_OR_RETURN(state->link, CoordinatorLink::Start(state->config, daemon, role, node, std::move(hooks)));
    return Status::Ok();
  };
  spec.stopping = [state, extra_stopping](Daemon&) {
    if (extra_stopping) extra_stopping();
    if (state->link) state->link->Leave(std::chrono::milliseconds(1000));
    state->link.reset();
  };
}

}  // namespace tandem
