#include "common/transport/ucx/address.h"

#include <cstring>

#include "common/logging.h"

namespace tandem::transport::ucx {
namespace {

constexpr char kMagic[4] = {'T', 'U', 'C', 'X'};
constexpr uint8_t kAddressVersion = 2;

class Writer {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Raw(&v, sizeof(v)); }
  void U32(uint32_t v) { Raw(&v, sizeof(v)); }
  void U64(uint64_t v) { Raw(&v, sizeof(v)); }
  void Bytes(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    out_ += s;
  }
  void Raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  bool Valid() const { return ok_; }
  template <typename T>
  T Get() {
    T v{};
    if (!Need(sizeof(T))) return v;
    std::memcpy(&v, in_.data(), sizeof(T));
    in_.remove_prefix(sizeof(T));
    return v;
  }
  std::string Bytes(size_t max) {
    const uint32_t n = Get<uint32_t>();
    if (n > max) ok_ = false;
    if (!ok_ || !Need(n)) return "";
    std::string s(in_.substr(0, n));
    in_.remove_prefix(n);
    return s;
  }
  bool AtEnd() const { return in_.empty(); }

 private:
  bool Need(size_t n) {
    if (in_.size() < n) ok_ = false;
    return ok_;
  }
  std::string_view in_;
  bool ok_ = true;
};

}  // namespace

std::string EncodeIdentity(const Identity& id) {
  Writer w;
  w.Raw(kMagic, sizeof(kMagic));
  w.U8(kAddressVersion);
  w.U8(id.has_verbs ? 1 : 0);
  w.U32(id.pid);
  w.U64(id.start_ticks);
  w.U64(id.pid_namespace);
  w.U64(id.net_namespace);
  w.Bytes(id.hostname);
  w.Bytes(id.boot_id);
  w.Bytes(id.shm_address);
  w.Bytes(id.net_address);
  return w.Take();
}

std::string DecodeIdentity(std::string_view in, Identity* id) {
  if (in.size() < sizeof(kMagic) || std::memcmp(in.data(), kMagic, sizeof(kMagic)) != 0) {
    return fmt::format("it does not start with the Tandem UCX marker ({} bytes)", in.size());
  }
  Reader r(in.substr(sizeof(kMagic)));
  const auto version = r.Get<uint8_t>();
  if (r.Valid() && version != kAddressVersion) {
    return fmt::format("address version {}, this build speaks version {}", version, kAddressVersion);
  }
  id->has_verbs = (r.Get<uint8_t>() & 1) != 0;
  id->pid = r.Get<uint32_t>();
  id->start_ticks = r.Get<uint64_t>();
  id->pid_namespace = r.Get<uint64_t>();
  id->net_namespace = r.Get<uint64_t>();
  id->hostname = r.Bytes(255);
  id->boot_id = r.Bytes(64);
  id->shm_address = r.Bytes(1 << 16);
  id->net_address = r.Bytes(1 << 16);
  if (!r.Valid() || !r.AtEnd()) return "it is truncated or has trailing bytes";
  if (id->shm_address.empty() && id->net_address.empty()) return "it has no UCX worker address";
  return "";
}

}  // namespace tandem::transport::ucx
