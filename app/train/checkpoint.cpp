#include "app/train/checkpoint.hpp"

#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <sstream>

#include "app/base/files.hpp"

namespace mnist_ddp {
namespace {

const char* const kManifest = "manifest";
const char* const kPrevious = "manifest.previous";  // the checkpoint before the newest

void add_state(const torch::nn::Module& module, const std::string& prefix, TensorDict& out) {
  for (const auto& p : module.named_parameters(/*recurse=*/false))
    out.insert(prefix + p.key(), p.value().detach().to(torch::kCPU).clone());
  for (const auto& b : module.named_buffers(/*recurse=*/false))
    out.insert(prefix + b.key(), b.value().detach().to(torch::kCPU).clone());
  for (const auto& child : module.named_children()) add_state(*child.value(), prefix + child.key() + ".", out);
}

// Names a save makes: its data files, and the temporary files of one cut short.
bool is_data_file(const std::string& name) { return name.rfind("model-", 0) == 0 || name.rfind("training-", 0) == 0; }
bool is_leftover(const std::string& name) { return name.find(".tmp.") != std::string::npos; }

// The checkpoint `manifest_name` in `dir` describes, every file verified
// against its size and CRC32. Throws CheckpointError saying what is wrong.
CheckpointFiles read_files(const files::Directory& dir, const std::string& manifest_name) {
  CheckpointFiles out;
  out.dir = dir.path();
  out.manifest_name = manifest_name;
  auto read = [&](const std::string& name) {
    try {
      return dir.read(name);
    } catch (const std::exception& e) {
      throw CheckpointError(e.what());
    }
  };
  out.manifest = read(manifest_name);
  const Manifest m = parse_manifest(std::string(out.manifest.begin(), out.manifest.end()), dir.path_of(manifest_name));
  for (const auto& [role, f] : m.files) {
    const std::string path = dir.path_of(f.name);
    if (!dir.has(f.name)) throw CheckpointError("checkpoint file " + path + " is missing");
    std::vector<char> bytes = read(f.name);
    if (bytes.size() != f.size)
      throw CheckpointError("checkpoint file " + path + " is truncated (" + std::to_string(bytes.size()) + " of " +
                            std::to_string(f.size) + " bytes)");
    if (crc32_of(bytes.data(), bytes.size()) != f.crc)
      throw CheckpointError("checkpoint file " + path + " is corrupt (CRC32 mismatch)");
    (role == "model" ? out.model : out.training) = std::move(bytes);
  }
  return out;
}

// The checkpoint `manifest_name` describes, if it is whole; nullopt if not.
std::optional<Manifest> intact(const files::Directory& dir, const std::string& manifest_name) {
  if (!dir.has(manifest_name)) return std::nullopt;
  try {
    const CheckpointFiles f = read_files(dir, manifest_name);
    return parse_manifest(std::string(f.manifest.begin(), f.manifest.end()), dir.path_of(manifest_name));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The generation for the next save: above every one `dir` holds a trace
// of, so that no save reuses the name of a file a manifest may still name.
int64_t next_generation(const files::Directory& dir) {
  int64_t newest = 0;
  for (const std::string& name : dir.list()) {
    if (!is_data_file(name)) continue;
    newest = std::max<int64_t>(newest, std::atoll(name.c_str() + name.find('-') + 1));
  }
  for (const char* manifest : {kManifest, kPrevious}) {
    if (!dir.has(manifest)) continue;
    try {
      const std::vector<char> text = dir.read(manifest);
      newest = std::max(newest, parse_manifest(std::string(text.begin(), text.end()), manifest).generation);
    } catch (const std::exception&) {
      // A damaged manifest: its files' names were counted above.
    }
  }
  return newest + 1;
}

}  // namespace

void write_file_atomically(const std::string& path, const std::vector<char>& bytes) {
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  files::Directory::open(dir).write_atomically(path.substr(slash == std::string::npos ? 0 : slash + 1), bytes);
}

TensorDict state_dict(const torch::nn::Module& module, const std::string& prefix) {
  TensorDict out;
  add_state(module, prefix, out);
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


void save_checkpoint(const std::string& path, const Checkpoint& c,
                     const std::function<void(const std::string&)>& after_each_write) {
  auto done = [&](const std::string& what) {
    if (after_each_write) after_each_write(what);
  };
  const files::Directory dir = files::Directory::open_own(path, /*create=*/true);

  // Fresh names for every save: no file a manifest names is ever touched.
  Manifest m;
  m.generation = next_generation(dir);
  m.counters = static_cast<const CheckpointCounters&>(c);
  for (const auto& [role, state] : {std::pair<std::string, const TensorDict*>{"model", &c.model}, {"training", &c.training}}) {
    const std::vector<char> bytes = serialize(*state);
    const ManifestFile f{role + "-" + std::to_string(m.generation) + ".pt", bytes.size(), crc32_of(bytes.data(), bytes.size())};
    dir.write_atomically(f.name, bytes);
    done("wrote " + f.name);
    m.files[role] = f;
  }
  // The newest checkpoint becomes the previous one only if it is whole: a
  // damaged newest (a run that resumed from the previous one) must not
  // push out the checkpoint that is. A kill between the two renames leaves
  // both manifests naming the same checkpoint.
  const std::optional<Manifest> newest = intact(dir, kManifest);
  if (newest) dir.write_atomically(kPrevious, dir.read(kManifest));
  const std::string text = manifest_text(m);
  dir.write_atomically(kManifest, std::vector<char>(text.begin(), text.end()));
  dir.sync();
  done("wrote manifest");

  // What neither manifest names: older checkpoints, and leftovers of saves
  // that were cut short.
  std::set<std::string> keep{kManifest, kPrevious};
  for (const auto& [role, f] : m.files) keep.insert(f.name);
  const std::optional<Manifest> previous = newest ? newest : intact(dir, kPrevious);
  if (previous)
    for (const auto& [role, f] : previous->files) keep.insert(f.name);
  for (const auto& name : dir.list())
    if ((is_data_file(name) || is_leftover(name)) && !keep.count(name)) dir.remove(name);
  done("removed stale files");
}

bool has_checkpoint(const std::string& dir) {
  return files::exists(files::join(dir, kManifest)) || files::exists(files::join(dir, kPrevious));
}

std::vector<std::string> checkpoint_leftovers(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& name : files::list_directory(dir))
    if (name != kManifest && name != kPrevious) out.push_back(name);
  std::sort(out.begin(), out.end());
  return out;
}

CheckpointFiles read_checkpoint_files(const std::string& path) {
  if (!files::is_directory(path)) throw CheckpointError(path + " is not a directory holding a checkpoint");
  files::Directory dir;
  try {
    dir = files::Directory::open(path);
  } catch (const std::exception& e) {
    throw CheckpointError(e.what());
  }
  if (!dir.has(kManifest) && !dir.has(kPrevious)) {
    const auto found = checkpoint_leftovers(path);
    throw CheckpointError("no checkpoint in " + path + ": it has no manifest" +
                          (found.empty() ? std::string(" (it is empty)") : ", only " + found.front() + (found.size() > 1 ? " and " + std::to_string(found.size() - 1) + " more" : "")));
  }
  std::string newest_wrong = "its newest checkpoint has no manifest";
  if (dir.has(kManifest)) {
    try {
      return read_files(dir, kManifest);
    } catch (const CheckpointError& e) {
      if (!dir.has(kPrevious)) throw;
      newest_wrong = e.what();
    }
  }
  try {
    CheckpointFiles out = read_files(dir, kPrevious);
    out.fallback = newest_wrong + "; using the checkpoint before it (" + dir.path_of(kPrevious) + ")";
    return out;
  } catch (const CheckpointError& e) {
    if (dir.has(kManifest)) throw CheckpointError(newest_wrong + "; and the checkpoint before it: " + e.what());
    throw CheckpointError(path + ": " + newest_wrong + ", and the checkpoint before it: " + e.what());
  }
}

Checkpoint parse_checkpoint(const CheckpointFiles& f) {
  const Manifest m = parse_manifest(std::string(f.manifest.begin(), f.manifest.end()), files::join(f.dir, f.manifest_name));
  Checkpoint c;
  static_cast<CheckpointCounters&>(c) = m.counters;
  c.model = deserialize(f.model, "checkpoint file " + files::join(f.dir, m.files.at("model").name));
  c.training = deserialize(f.training, "checkpoint file " + files::join(f.dir, m.files.at("training").name));
  return c;
}

std::optional<Checkpoint> read_manifest(const std::string& dir) {
  try {
    const CheckpointFiles f = read_checkpoint_files(dir);
    Checkpoint c;
    static_cast<CheckpointCounters&>(c) = parse_manifest(std::string(f.manifest.begin(), f.manifest.end()), f.manifest_name).counters;
    return c;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

Checkpoint load_checkpoint(const std::string& dir) { return parse_checkpoint(read_checkpoint_files(dir)); }

}  // namespace mnist_ddp
