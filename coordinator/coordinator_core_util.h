// Small conversions and names that the coordinator core's source files share
// (coordinator_core.cc, coordinator_log.cc, coordinator_status.cc): durations and timestamps
// to and from protobuf, member state and role names, and a member's host key.
// Internal to the core: not part of its interface.
//
// Thread safety: pure functions.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include <google/protobuf/duration.pb.h>
#include <google/protobuf/timestamp.pb.h>
#include <google/protobuf/util/time_util.h>

#include "tandem/v1/coordinator.pb.h"

namespace tandem::coordinator::core_util {

inline std::chrono::milliseconds ToMs(const google::protobuf::Duration& d) {
  return std::chrono::milliseconds(google::protobuf::util::TimeUtil::DurationToMilliseconds(d));
}

inline google::protobuf::Duration FromMs(std::chrono::milliseconds ms) {
  return google::protobuf::util::TimeUtil::MillisecondsToDuration(ms.count());
}

inline google::protobuf::Timestamp Timestamp(int64_t unix_ms) {
  return google::protobuf::util::TimeUtil::MillisecondsToTimestamp(unix_ms);
}

inline std::string StateName(v1::MemberState s) {
  switch (s) {
    case v1::MEMBER_STATE_JOINING:
      return "joining";
    case v1::MEMBER_STATE_ACTIVE:
      return "active";
    case v1::MEMBER_STATE_DRAINING:
      return "draining";
    case v1::MEMBER_STATE_LEFT:
      return "left";
    case v1::MEMBER_STATE_DEAD:
      return "dead";
    case v1::MEMBER_STATE_HELD_OUT:
      return "held_out";
    default:
      return "unspecified";
  }
}

inline std::string RoleName(v1::Role r) {
  return r == v1::ROLE_SERVER ? "server" : "worker";
}

// The host a member's failures count against: its node id, or its hostname
// when it gave none.
inline std::string HostKey(const v1::NodeIdentity& node) {
  return node.node_id().empty() ? node.hostname() : node.node_id();
}

}  // namespace tandem::coordinator::core_util
