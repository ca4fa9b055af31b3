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
// own. `extra_started` runs before the member registers and may describe the
// node (devices, capabilities) in the NodeIdentity it is given.
void MakeMemberSpec(DaemonSpec& spec, v1::Role role, std::function<void(OptionSet&)> extra_declare,
                    std::function<Status(Daemon&, v1::NodeIdentity*)> extra_started);

}  // namespace tandem
