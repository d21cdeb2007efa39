#include "app/train/manifest.hpp"

#include <zlib.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>
#include <sstream>

namespace mnist_ddp {
namespace {

const char* const kFormat1 = "mnist_ddp checkpoint 1";  // no checksum
const char* const kFormat = "mnist_ddp checkpoint 2";

std::string hex32(uint32_t v) {
  char text[16];
  std::snprintf(text, sizeof text, "%08x", v);
  return text;
}

// One line's words after its key, read strictly.
class Line {
 public:
  Line(const std::string& text, int number, const std::string& where) : text_(text), number_(number), where_(where) {}

  [[noreturn]] void fail(const std::string& why) const {
    throw CheckpointError(where_ + " is damaged: line " + std::to_string(number_) + " '" + text_.substr(0, 80) +
                          "' " + why);
  }

  // A whole number in [min, max].
  int64_t integer(const std::string& word, int64_t min, int64_t max) const {
    errno = 0;
    char* end = nullptr;
    const long long v = std::strtoll(word.c_str(), &end, 10);
    if (word.empty() || *end || errno || v < min || v > max || !(std::isdigit(static_cast<unsigned char>(word[0])) || word[0] == '-'))
      fail("holds '" + word + "' where a whole number in " + std::to_string(min) + ".." + std::to_string(max) +
           " belongs");
    return v;
  }

  double real(const std::string& word, double min, double max) const {
    char* end = nullptr;
    const double v = std::strtod(word.c_str(), &end);
    if (word.empty() || *end || !std::isfinite(v) || v < min || v > max)
      fail("holds '" + word + "' where a number in [" + std::to_string(min) + ", " + std::to_string(max) + "] belongs");
    return v;
  }

  uint32_t crc(const std::string& word) const {
    char* end = nullptr;
    const unsigned long v = std::strtoul(word.c_str(), &end, 16);
    if (word.size() != 8 || *end || word.find_first_not_of("0123456789abcdef") != std::string::npos)
      fail("holds '" + word + "' where a CRC32 of 8 hex digits belongs");
    return static_cast<uint32_t>(v);
  }

  // The line's words, split on single spaces, checked for their count.
  std::vector<std::string> words(size_t count) const {
    std::vector<std::string> out;
    std::istringstream in(text_);
    for (std::string w; in >> w;) out.push_back(w);
    if (out.size() != count) fail("has " + std::to_string(out.size()) + " words, not " + std::to_string(count));
    return out;
  }

 private:
  const std::string& text_;
  int number_;
  const std::string& where_;
};

}  // namespace

uint32_t crc32_of(const char* data, size_t n) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (size_t at = 0; at < n; at += 1u << 30) {
    const auto chunk = static_cast<uInt>(std::min<size_t>(n - at, 1u << 30));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(data + at), chunk);
  }
  return static_cast<uint32_t>(crc);
}

std::string manifest_text(const Manifest& m) {
  const CheckpointCounters& c = m.counters;
  std::ostringstream out;
  char best[64];
  std::snprintf(best, sizeof best, "%.17g", c.best_accuracy);
  out << kFormat << "\n"
      << "generation " << m.generation << "\n"
      << "epoch " << c.epoch << "\n"
      << "batch " << c.batch << "\n"
      << "step " << c.step << "\n"
      << "best_accuracy " << best << "\n"
      << "world_size " << c.world_size << "\n"
      << "compression " << c.compression << "\n";
  for (const auto& [role, f] : m.files) out << "file " << role << " " << f.name << " " << f.size << " " << hex32(f.crc) << "\n";
  for (const auto& [name, value] : c.arguments) out << "arg " << name << " " << value << "\n";
  const std::string body = out.str();
  return body + "checksum " + hex32(crc32_of(body.data(), body.size())) + "\n";
}

Manifest parse_manifest(const std::string& text, const std::string& where) {
  const size_t first_end = text.find('\n');
  const std::string format = text.substr(0, first_end);
  if (format != kFormat && format != kFormat1) throw CheckpointError(where + " is not a mnist_ddp checkpoint manifest");
  std::string body = text;
  if (format == kFormat) {
    // The checksum line is the last; what precedes it is what it covers.
    const size_t at = text.rfind("\nchecksum ", text.size() >= 2 ? text.size() - 2 : 0);
    if (text.empty() || text.back() != '\n' || at == std::string::npos)
      throw CheckpointError(where + " is damaged: it is cut short (no checksum line at its end)");
    body = text.substr(0, at + 1);
    const std::string line = text.substr(at + 1, text.size() - at - 2);
    const uint32_t stated = Line(line, 0, where).crc(line.substr(9));
    if (stated != crc32_of(body.data(), body.size()))
      throw CheckpointError(where + " is damaged: its checksum does not match its contents");
  }

  Manifest m;
  m.format = format == kFormat ? 2 : 1;
  CheckpointCounters& c = m.counters;
  std::set<std::string> seen;
  std::istringstream lines(body.substr(first_end + 1));
  int number = 1;
  for (std::string text_line; std::getline(lines, text_line);) {
    const Line line(text_line, ++number, where);
    const std::string key = text_line.substr(0, text_line.find(' '));
    if (key != "file" && key != "arg" && !seen.insert(key).second) line.fail("repeats '" + key + "'");
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    if (key == "generation") m.generation = line.integer(line.words(2)[1], 1, kMax);
    else if (key == "epoch") c.epoch = line.integer(line.words(2)[1], 0, kMax);
    else if (key == "batch") c.batch = line.integer(line.words(2)[1], 0, kMax);
    else if (key == "step") c.step = line.integer(line.words(2)[1], 0, kMax);
    else if (key == "best_accuracy") c.best_accuracy = line.real(line.words(2)[1], 0, 100);
    else if (key == "world_size") c.world_size = static_cast<int>(line.integer(line.words(2)[1], 1, 1 << 24));
    else if (key == "compression") c.compression = text_line.size() > 12 ? text_line.substr(12) : "";
    else if (key == "file") {
      const auto w = line.words(5);
      if (w[1] != "model" && w[1] != "training") line.fail("names the unknown role '" + w[1] + "'");
      if (w[2].find('/') != std::string::npos || w[2].rfind(w[1] + "-", 0) != 0) line.fail("names a file not of this checkpoint");
      if (m.files.count(w[1])) line.fail("names a second " + w[1] + " file");
      m.files[w[1]] = {w[2], static_cast<uint64_t>(line.integer(w[3], 0, kMax)), line.crc(w[4])};
    } else if (key == "arg") {
      const size_t name_end = text_line.find(' ', 4);
      if (text_line.size() < 5 || name_end == 4) line.fail("names no argument");
      c.arguments.emplace_back(text_line.substr(4, name_end - 4),
                               name_end == std::string::npos ? std::string() : text_line.substr(name_end + 1));
    } else {
      line.fail("is not a manifest entry");
    }
  }
  for (const char* key : {"epoch", "batch", "step", "best_accuracy", "world_size", "compression"})
    if (!seen.count(key)) throw CheckpointError(where + " is damaged: it has no " + key + " line");
  if (format == kFormat && !seen.count("generation")) throw CheckpointError(where + " is damaged: it has no generation line");
  for (const char* role : {"model", "training"})
    if (!m.files.count(role)) throw CheckpointError(where + " is damaged: it names no " + std::string(role) + " file");
  return m;
}

}  // namespace mnist_ddp
