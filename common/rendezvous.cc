#include "common/rendezvous.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace tandem::comm {
namespace {

constexpr size_t kMaxValue = 64 << 10;

Status CheckKey(const std::string& key) {
  if (key.empty() || key.size() > 256)
    return InvalidArgument("rendezvous key must be 1 to 256 bytes, got {}", key.size());
  return Status::Ok();
}

}  // namespace

FileRendezvous::FileRendezvous(std::string dir) : dir_(std::move(dir)) {}

std::string FileRendezvous::PathOf(const std::string& key) const {
  std::string name;
  for (char c : key) name += (c == '/' ? '%' : c);
  return dir_ + "/" + name;
}

Status FileRendezvous::Put(const std::string& key, const std::string& value) {
  TANDEM_RETURN_IF_ERROR(CheckKey(key));
  if (value.size() > kMaxValue)
    return InvalidArgument("rendezvous value for {} is {} bytes, more than 64 KiB", key, value.size());
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) return Unavailable("cannot create rendezvous directory {}: {}", dir_, ec.message());
  const std::string path = PathOf(key);
  if (std::filesystem::exists(path)) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream existing;
    existing << in.rdbuf();
    if (existing.str() == value) return Status::Ok();
    return AlreadyExists("rendezvous key {} already holds another value", key);
  }
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(value.data(), static_cast<std::streamsize>(value.size()));
    if (!out.flush()) return Unavailable("cannot write {}", tmp);
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) return Unavailable("cannot publish rendezvous key {}: {}", key, ec.message());
  return Status::Ok();
}

Result<std::string> FileRendezvous::Get(const std::string& key, std::chrono::milliseconds timeout) {
  TANDEM_RETURN_IF_ERROR(CheckKey(key));
  const std::string path = PathOf(key);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(200);
  while (true) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::stringstream value;
      value << in.rdbuf();
      return value.str();
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return DeadlineExceeded("rendezvous key {} did not appear in {} within {} ms", key, dir_, timeout.count());
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(20));
  }
}

Status MemoryRendezvous::Put(const std::string& key, const std::string& value) {
  TANDEM_RETURN_IF_ERROR(CheckKey(key));
  MutexLock lock(&mu_);
  auto [it, inserted] = values_.emplace(key, value);
  if (!inserted && it->second != value) return AlreadyExists("rendezvous key {} already holds another value", key);
  cv_.NotifyAll();
  return Status::Ok();
}

Result<std::string> MemoryRendezvous::Get(const std::string& key, std::chrono::milliseconds timeout) {
  TANDEM_RETURN_IF_ERROR(CheckKey(key));
  MutexLock lock(&mu_);
  if (!cv_.WaitFor(lock, timeout, [&]() TANDEM_REQUIRES(mu_) { return values_.count(key) > 0; })) {
    return DeadlineExceeded("rendezvous key {} did not appear within {} ms", key, timeout.count());
  }
  return values_.at(key);
}

}  // namespace tandem::comm
