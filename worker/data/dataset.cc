// The training data (dataset.h): reading a text file, its windows, and the
// generated default corpus.
#include "worker/data/dataset.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

namespace tandem::data {
namespace {

// An unbiased integer in [0, bound) from mt19937_64 by rejection (bound > 0).
// std::uniform_int_distribution is not specified bit for bit, so it would
// give different corpora with different standard libraries.
uint64_t Uniform(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
  for (;;) {
    const uint64_t r = rng();
    if (r >= threshold) return r % bound;
  }
}

template <size_t N>
std::string_view Pick(std::mt19937_64& rng, const std::array<std::string_view, N>& words) {
  return words[Uniform(rng, N)];
}

constexpr std::array<std::string_view, 24> kNouns = {"river",   "teacher", "machine", "garden", "village",  "sailor",
                                                     "letter",  "storm",   "lantern", "market", "engine",   "forest",
                                                     "bridge",  "child",   "painter", "clock",  "mountain", "harbor",
                                                     "library", "farmer",  "window",  "road",   "singer",   "kitchen"};
constexpr std::array<std::string_view, 20> kAdjectives = {
    "quiet", "old",    "bright", "patient", "narrow", "distant", "careful", "small",  "heavy",   "gentle",
    "green", "broken", "early",  "curious", "silver", "warm",    "tired",   "simple", "strange", "busy"};
constexpr std::array<std::string_view, 20> kVerbs = {"watched",   "carried",  "followed", "remembered", "built",
                                                     "painted",   "opened",   "crossed",  "found",      "repaired",
                                                     "described", "visited",  "counted",  "lifted",     "sold",
                                                     "studied",   "answered", "welcomed", "measured",   "closed"};
constexpr std::array<std::string_view, 12> kIntransitive = {"waited",   "laughed",  "slept",  "arrived",
                                                            "wandered", "listened", "worked", "sang",
                                                            "returned", "rested",   "spoke",  "hurried"};
constexpr std::array<std::string_view, 12> kAdverbs = {"slowly",        "quietly",        "at last",   "again",
                                                       "every morning", "without a word", "early",     "late",
                                                       "gladly",        "by noon",        "once more", "in the rain"};
constexpr std::array<std::string_view, 10> kPlaces = {
    "near the river", "across the valley",  "behind the market", "under the bridge", "beside the window",
    "along the road", "in the old library", "at the harbor",     "past the garden",  "on the mountain"};
constexpr std::array<std::string_view, 8> kConnectives = {"and",     "but",   "so",       "while",
                                                          "because", "until", "although", "before"};
constexpr std::array<std::string_view, 8> kOpeners = {
    "In the evening", "Long ago", "That winter", "After the rain", "Some days", "By the spring", "At dawn", "Later"};

std::string Capitalised(std::string s) {
  if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = static_cast<char>(s[0] - 'a' + 'A');
  return s;
}

// "the quiet river" / "a teacher" / "every old clock"
std::string NounPhrase(std::mt19937_64& rng) {
  std::string np;
  switch (Uniform(rng, 4)) {
    case 0:
      np = "the ";
      break;
    case 1:
      np = "a ";
      break;
    case 2:
      np = "every ";
      break;
    default:
      np = "the ";
      np += Pick(rng, kAdjectives);
      np += ' ';
      break;
  }
  std::string noun(Pick(rng, kNouns));
  if (np == "a " && (noun[0] == 'a' || noun[0] == 'e' || noun[0] == 'i' || noun[0] == 'o' || noun[0] == 'u')) {
    np = "an ";
  }
  return np + noun;
}

std::string Clause(std::mt19937_64& rng) {
  std::string c = NounPhrase(rng);
  c += ' ';
  if (Uniform(rng, 3) == 0) {
    c += Pick(rng, kIntransitive);
  } else {
    c += Pick(rng, kVerbs);
    c += ' ';
    c += NounPhrase(rng);
  }
  switch (Uniform(rng, 3)) {
    case 0:
      c += ' ';
      c += Pick(rng, kAdverbs);
      break;
    case 1:
      c += ' ';
      c += Pick(rng, kPlaces);
      break;
    default:
      break;
  }
  return c;
}

std::string Sentence(std::mt19937_64& rng) {
  std::string s;
  if (Uniform(rng, 4) == 0) {
    s = std::string(Pick(rng, kOpeners)) + ", " + Clause(rng);
  } else {
    s = Capitalised(Clause(rng));
  }
  if (Uniform(rng, 2) == 0) {
    s += Uniform(rng, 2) == 0 ? ", " : " ";
    s += Pick(rng, kConnectives);
    s += ' ';
    s += Clause(rng);
  }
  s += Uniform(rng, 10) == 0 ? '?' : (Uniform(rng, 12) == 0 ? '!' : '.');
  return s;
}

}  // namespace

std::string DefaultCorpus(size_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string out;
  out.reserve(bytes + 256);
  while (out.size() < bytes) {
    // A paragraph of 3 to 7 sentences, then a blank line.
    const uint64_t sentences = 3 + Uniform(rng, 5);
    for (uint64_t i = 0; i < sentences; ++i) {
      if (i > 0) out += ' ';
      out += Sentence(rng);
    }
    out += "\n\n";
  }
  out.resize(bytes);
  return out;
}

Status WriteDefaultCorpus(const std::string& path, size_t bytes) {
  const std::string corpus = DefaultCorpus(bytes);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return FailedPrecondition("cannot write the default corpus to '{}': {}", path, std::strerror(errno));
  size_t done = 0;
  while (done < corpus.size()) {
    const ssize_t n = ::write(fd, corpus.data() + done, corpus.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      return FailedPrecondition("writing the default corpus to '{}': {}", path, std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) {
    return FailedPrecondition("writing the default corpus to '{}': {}", path, std::strerror(errno));
  }
  return Status::Ok();
}

TextDataset::TextDataset(std::string name, std::unique_ptr<std::string> bytes, size_t context, size_t stride)
    : name_(std::move(name)),
      bytes_(std::move(bytes)),
      context_(context),
      stride_(stride),
      count_((bytes_->size() - (context + 1)) / stride + 1) {}

Result<TextDataset> TextDataset::FromBytes(std::string bytes, size_t context, size_t stride, std::string name) {
  if (context == 0) return InvalidArgument("data '{}': context must be at least 1 byte", name);
  if (stride == 0) stride = context;
  if (bytes.size() < context + 1) {
    return InvalidArgument("data '{}' is too small: it has {} bytes, and one sample of context {} needs {}", name,
                           bytes.size(), context, context + 1);
  }
  return TextDataset(std::move(name), std::make_unique<std::string>(std::move(bytes)), context, stride);
}

Result<TextDataset> TextDataset::Open(const std::string& path, size_t context, size_t stride) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) return NotFound("data file '{}' does not exist", path);
    if (err == EACCES || err == EPERM)
      return PermissionDenied("data file '{}' cannot be read: {}", path, std::strerror(err));
    return FailedPrecondition("cannot open data file '{}': {}", path, std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgument("data file '{}' is not a regular file", path);
  }
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return FailedPrecondition("reading data file '{}': {}", path, std::strerror(err));
    }
    if (n == 0) break;  // the file shrank while we read it
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  bytes.resize(done);
  return FromBytes(std::move(bytes), context, stride, path);
}

Result<TextDataset> TextDataset::Default(size_t context, size_t stride) {
  return FromBytes(DefaultCorpus(), context, stride, "<default corpus>");
}

std::span<const uint8_t> TextDataset::bytes() const {
  return {reinterpret_cast<const uint8_t*>(bytes_->data()), bytes_->size()};
}

std::span<const uint8_t> TextDataset::Window(size_t i) const {
  return bytes().subspan(i * stride_, context_ + 1);
}

Sample TextDataset::Get(size_t i) const {
  const std::span<const uint8_t> w = Window(i);
  return Sample{w.first(context_), w.subspan(1, context_)};
}

}  // namespace tandem::data
