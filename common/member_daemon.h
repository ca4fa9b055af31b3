// The DaemonSpec shared by the members of a job (parameter servers and
// workers): the coordinator link options, a member session with the
// coordinator, readiness that follows it, and a graceful leave on shutdown.
#pragma once

#include <functional>
#include <memory>

#include "common/coordinator_link.h"
#include "common/daemon.h"

namespace tandem {

// Fills in `spec.declare`, `spec.started` and `spec.stopping` so the member
// follows its coordinator; `extra_declare` and `extra_started` add the role's
// own. `extra_started` runs before the member registers; it may describe the
// node (devices, capabilities) in the NodeIdentity and hook into the member
// session (endpoints, epochs, heartbeat progress) through MemberHooks.
// `extra_stopping` runs before the member leaves the job.
void MakeMemberSpec(DaemonSpec& spec, v1::Role role, std::function<void(OptionSet&)> extra_declare,
                    std::function<Status(Daemon&, v1::NodeIdentity*, MemberHooks*)> extra_started,
                    std::function<void()> extra_stopping = nullptr);

}  // namespace tandem
