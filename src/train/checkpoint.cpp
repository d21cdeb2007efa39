#include "mnist_ddp/train/checkpoint.hpp"
#include "mnist_ddp/base/files.hpp"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <torch/csrc/jit/serialization/pickle.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

namespace mnist_ddp {
namespace {

constexpr const char* kFormat = "mnist_ddp checkpoint 1";

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw std::runtime_error("cannot write " + path + ": " + what + ": " + std::strerror(errno));
}

void add_state(const torch::nn::Module& module, const std::string& prefix, TensorDict& out) {
  for (const auto& p : module.named_parameters(/*recurse=*/false))
    out.insert(prefix + p.key(), p.value().detach().to(torch::kCPU).clone());
  for (const auto& b : module.named_buffers(/*recurse=*/false))
    out.insert(prefix + b.key(), b.value().detach().to(torch::kCPU).clone());
  for (const auto& child : module.named_children()) add_state(*child.value(), prefix + child.key() + ".", out);
}

uint32_t crc_of(const std::vector<char>& bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (size_t at = 0; at < bytes.size(); at += 1u << 30) {
    const auto n = static_cast<uInt>(std::min<size_t>(bytes.size() - at, 1u << 30));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(bytes.data() + at), n);
  }
  return static_cast<uint32_t>(crc);
}

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError("cannot read " + path + ": " + std::strerror(errno));
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

void sync_directory(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    fsync(fd);
    close(fd);
  }
}

struct ManifestFile {
  std::string name;
  uint64_t size = 0;
  uint32_t crc = 0;
};

const char* const kManifest = "manifest";
const char* const kPrevious = "manifest.previous";  // the checkpoint before the newest

std::map<std::string, ManifestFile> parse_manifest(const std::string& text, const std::string& manifest, Checkpoint& c);

// The generation of the checkpoint in `dir`, 0 if there is none.
int64_t current_generation(const std::string& dir) {
  std::ifstream in(files::join(dir, "manifest"));
  std::string line;
  while (std::getline(in, line)) {
    int64_t generation = 0;
    if (std::sscanf(line.c_str(), "generation %" SCNd64, &generation) == 1) return generation;
  }
  return 0;
}

}  // namespace

void write_file_atomically(const std::string& path, const std::vector<char>& bytes) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("open", tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int saved = errno;
      close(fd);
      unlink(tmp.c_str());
      errno = saved;
      fail("write", tmp);
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0 || close(fd) != 0) {
    const int saved = errno;
    unlink(tmp.c_str());
    errno = saved;
    fail("fsync", tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int saved = errno;
    unlink(tmp.c_str());
    errno = saved;
    fail("rename", path);
  }
}

TensorDict state_dict(const torch::nn::Module& module) {
  TensorDict out;
  add_state(module, "", out);
  return out;
}

std::vector<char> serialize(const TensorDict& state) { return torch::jit::pickle_save(c10::IValue(state)); }

TensorDict deserialize(const std::vector<char>& bytes, const std::string& what) {
  c10::IValue value;
  try {
    value = torch::jit::pickle_load(bytes);
  } catch (const std::exception&) {
    throw CheckpointError(what + " is not a file torch.save wrote");
  }
  if (!value.isGenericDict()) throw CheckpointError(what + " does not hold a dict of tensors");
  TensorDict out;
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString() || !item.value().isTensor())
      throw CheckpointError(what + " does not hold a dict of tensors");
    out.insert(item.key().toStringRef(), item.value().toTensor());
  }
  return out;
}

void load_state_dict(torch::nn::Module& module, const TensorDict& state, const std::string& prefix,
                     const std::string& what) {
  const TensorDict own = state_dict(module);
  std::string problem;
  for (const auto& item : own) {
    const std::string name = prefix + item.key();
    if (!state.contains(name)) {
      problem = "it has no " + name;
    } else if (state.at(name).sizes() != item.value().sizes()) {
      std::ostringstream s;
      s << name << " is " << state.at(name).sizes() << ", the model's " << item.value().sizes();
      problem = s.str();
    }
    if (!problem.empty()) break;
  }
  if (problem.empty() && state.size() != own.size())
    problem = "it holds " + std::to_string(state.size()) + " tensors, the model " + std::to_string(own.size());
  if (!problem.empty()) throw CheckpointError(what + " holds a different model: " + problem);

  torch::NoGradGuard no_grad;
  auto params = module.named_parameters();
  auto buffers = module.named_buffers();
  for (const auto& item : own) {
    torch::Tensor* target = params.find(item.key());
    if (!target) target = buffers.find(item.key());
    target->copy_(state.at(prefix + item.key()));
  }
}

void save_state_dict(const std::string& path, const TensorDict& state) { write_file_atomically(path, serialize(state)); }

void save_checkpoint(const std::string& dir, const Checkpoint& c,
                     const std::function<void(const std::string&)>& after_each_write) {
  auto done = [&](const std::string& what) {
    if (after_each_write) after_each_write(what);
  };
  files::make_directories(dir);

  // Fresh names for every save: the current manifest's files are never touched.
  const std::string generation = std::to_string(current_generation(dir) + 1);
  std::vector<std::pair<std::string, ManifestFile>> files;
  for (const auto& [role, state] : {std::pair<std::string, const TensorDict*>{"model", &c.model}, {"training", &c.training}}) {
    const std::vector<char> bytes = serialize(*state);
    ManifestFile f{role + "-" + generation + ".pt", bytes.size(), crc_of(bytes)};
    write_file_atomically(files::join(dir, f.name), bytes);
    done("wrote " + f.name);
    files.emplace_back(role, f);
  }

  std::ostringstream m;
  char best[64];
  std::snprintf(best, sizeof best, "%.17g", c.best_accuracy);
  m << kFormat << "\n"
    << "generation " << generation << "\n"
    << "epoch " << c.epoch << "\n"
    << "batch " << c.batch << "\n"
    << "step " << c.step << "\n"
    << "best_accuracy " << best << "\n"
    << "world_size " << c.world_size << "\n"
    << "compression " << c.compression << "\n";
  for (const auto& [role, f] : files) {
    char crc[16];
    std::snprintf(crc, sizeof crc, "%08x", f.crc);
    m << "file " << role << " " << f.name << " " << f.size << " " << crc << "\n";
  }
  for (const auto& [name, value] : c.arguments) m << "arg " << name << " " << value << "\n";
  const std::string text = m.str();
  // The checkpoint being replaced stays, as the previous one. A kill between
  // the two renames leaves both manifests naming the same checkpoint.
  const std::string manifest = files::join(dir, kManifest), previous = files::join(dir, kPrevious);
  if (files::exists(manifest)) write_file_atomically(previous, read_bytes(manifest));
  write_file_atomically(manifest, std::vector<char>(text.begin(), text.end()));
  sync_directory(dir);
  done("wrote manifest");

  // What neither manifest refers to: older checkpoints, and leftovers of
  // saves that were interrupted.
  std::set<std::string> keep{kManifest, kPrevious};
  for (const auto& [role, f] : files) keep.insert(f.name);
  if (files::exists(previous)) {
    try {
      const std::vector<char> bytes = read_bytes(previous);
      Checkpoint ignored;
      for (const auto& [role, f] : parse_manifest(std::string(bytes.begin(), bytes.end()), previous, ignored))
        keep.insert(f.name);
    } catch (const CheckpointError&) {
      // An unreadable previous manifest keeps nothing alive.
    }
  }
  for (const auto& name : files::list_directory(dir)) {
    const bool ours = name.rfind("model-", 0) == 0 || name.rfind("training-", 0) == 0 || name.find(".tmp.") != std::string::npos;
    if (ours && !keep.count(name)) files::remove_file(files::join(dir, name));
  }
  done("removed stale files");
}

bool has_checkpoint(const std::string& dir) { return files::exists(files::join(dir, "manifest")); }

namespace {

// The manifest's counters and arguments into `c`, its files by role.
std::map<std::string, ManifestFile> parse_manifest(const std::string& text, const std::string& manifest, Checkpoint& c) {
  std::istringstream in(text);
  std::string line;
  if (!std::getline(in, line) || line != kFormat)
    throw CheckpointError(manifest + " is not a mnist_ddp checkpoint manifest");
  std::map<std::string, ManifestFile> files;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string key;
    words >> key;
    if (key == "epoch") words >> c.epoch;
    else if (key == "batch") words >> c.batch;
    else if (key == "step") words >> c.step;
    else if (key == "best_accuracy") words >> c.best_accuracy;
    else if (key == "world_size") words >> c.world_size;
    else if (key == "compression") words >> c.compression;
    else if (key == "file") {
      std::string role, crc;
      ManifestFile f;
      words >> role >> f.name >> f.size >> crc;
      f.crc = static_cast<uint32_t>(std::stoul(crc, nullptr, 16));
      files[role] = f;
    } else if (key == "arg") {
      std::string name, value;
      words >> name;
      std::getline(words >> std::ws, value);
      c.arguments.emplace_back(name, value);
    }
    if (words.fail() && key != "arg") throw CheckpointError(manifest + ": cannot read the line '" + line + "'");
  }
  for (const std::string role : {"model", "training"})
    if (!files.count(role)) throw CheckpointError(manifest + " names no " + role + " file");
  return files;
}

}  // namespace

namespace {

// The checkpoint that `manifest_name` in `dir` describes, verified.
CheckpointFiles read_files(const std::string& dir, const std::string& manifest_name) {
  const std::string manifest = files::join(dir, manifest_name);
  CheckpointFiles out;
  out.dir = dir;
  out.manifest_name = manifest_name;
  out.manifest = read_bytes(manifest);
  Checkpoint counters;
  for (const auto& [role, f] : parse_manifest(std::string(out.manifest.begin(), out.manifest.end()), manifest, counters)) {
    const std::string path = files::join(dir, f.name);
    if (!files::exists(path)) throw CheckpointError("checkpoint file " + path + " is missing");
    std::vector<char> bytes = read_bytes(path);
    if (bytes.size() != f.size)
      throw CheckpointError("checkpoint file " + path + " is truncated (" + std::to_string(bytes.size()) + " of " +
                            std::to_string(f.size) + " bytes)");
    if (crc_of(bytes) != f.crc) throw CheckpointError("checkpoint file " + path + " is corrupt (CRC32 mismatch)");
    (role == "model" ? out.model : out.training) = std::move(bytes);
  }
  return out;
}

}  // namespace

CheckpointFiles read_checkpoint_files(const std::string& dir) {
  if (!files::is_directory(dir)) throw CheckpointError(dir + " is not a directory holding a checkpoint");
  if (!files::exists(files::join(dir, kManifest))) throw CheckpointError("no checkpoint in " + dir + " (it has no manifest)");
  try {
    return read_files(dir, kManifest);
  } catch (const CheckpointError& newest) {
    if (!files::exists(files::join(dir, kPrevious))) throw;
    try {
      CheckpointFiles out = read_files(dir, kPrevious);
      out.fallback = std::string(newest.what()) + "; using the checkpoint before it";
      return out;
    } catch (const CheckpointError&) {
      throw newest;
    }
  }
}

Checkpoint parse_checkpoint(const CheckpointFiles& f) {
  Checkpoint c;
  const std::string manifest = files::join(f.dir, f.manifest_name);
  const auto named = parse_manifest(std::string(f.manifest.begin(), f.manifest.end()), manifest, c);
  c.model = deserialize(f.model, "checkpoint file " + files::join(f.dir, named.at("model").name));
  c.training = deserialize(f.training, "checkpoint file " + files::join(f.dir, named.at("training").name));
  return c;
}

std::optional<Checkpoint> read_manifest(const std::string& dir) {
  const std::string manifest = files::join(dir, "manifest");
  if (!files::exists(manifest)) return std::nullopt;
  try {
    const std::vector<char> text = read_bytes(manifest);
    Checkpoint c;
    parse_manifest(std::string(text.begin(), text.end()), manifest, c);
    return c;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

Checkpoint load_checkpoint(const std::string& dir) { return parse_checkpoint(read_checkpoint_files(dir)); }

}  // namespace mnist_ddp
