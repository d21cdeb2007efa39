#include "app/train/checkpoint.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <sstream>

#include "app/base/files.hpp"

namespace mnist_ddp {
namespace {

const char* const kManifest = "manifest";
const char* const kPrevious = "manifest.previous";  // the checkpoint before the newest
// In a training file: its save's manifest, as it stood before the file
// itself (its own entry size 0), and 1 where the directory held no
// manifest at that save (a first save).
const char* const kEmbedded = "checkpoint/manifest";
const char* const kFirstSave = "checkpoint/first_save";

// A data file's name: role-<generation>[-<lineage>].pt.
struct DataName {
  std::string role;
  int64_t generation = 0;
  std::string lineage;
};

std::string data_file(const std::string& role, int64_t generation, const std::string& lineage) {
  return role + "-" + std::to_string(generation) + (lineage.empty() ? "" : "-" + lineage) + ".pt";
}

std::optional<DataName> data_name(const std::string& name) {
  for (const char* role : {"model", "training"}) {
    const std::string prefix = std::string(role) + "-";
    if (name.rfind(prefix, 0) != 0 || name.size() < prefix.size() + 4 || name.compare(name.size() - 3, 3, ".pt") != 0)
      continue;
    const std::string middle = name.substr(prefix.size(), name.size() - prefix.size() - 3);
    const size_t dash = middle.find('-');
    const std::string generation = middle.substr(0, dash);
    if (generation.empty() || generation.size() > 18 || generation.find_first_not_of("0123456789") != std::string::npos)
      return std::nullopt;
    return DataName{role, std::atoll(generation.c_str()), dash == std::string::npos ? "" : middle.substr(dash + 1)};
  }
  return std::nullopt;
}

// Whether a save of `lineage` knows `name` for its own: a data file of its
// lineage (a save of none: one of none, as written before lineages), or
// the temporary file of one, or of a manifest, that a save cut short left.
bool of_lineage(const std::string& name, const std::string& lineage) {
  std::string file = name;
  if (const size_t tmp = name.find(".tmp."); tmp != std::string::npos) {
    if (name[0] != '.') return false;
    file = name.substr(1, tmp - 1);
    if (file == kManifest || file == kPrevious) return true;
  }
  const std::optional<DataName> d = data_name(file);
  return d && d->lineage == lineage;
}

// A symbolic link under a name a save writes: never a save's (a save
// follows no link), and removing it leaves what it points to as it is.
bool planted(const files::Directory& dir, const std::string& name) {
  return dir.is_link(name) && (data_name(name) || name.find(".tmp.") != std::string::npos);
}

// The files `manifest_name` names, as far as it can be read.
std::set<std::string> named_by(const files::Directory& dir, const char* manifest_name) {
  std::set<std::string> out;
  try {
    const std::vector<char> text = dir.read(manifest_name);
    for (const auto& [role, f] : parse_manifest(std::string(text.begin(), text.end()), manifest_name).files)
      out.insert(f.name);
  } catch (const std::exception&) {
  }
  return out;
}

std::string some_of(const std::vector<std::string>& names) {
  std::string out = names.front();
  if (names.size() > 1) out += (names.size() == 2 ? " and " : ", ") + names[1];
  if (names.size() > 2) out += " and " + std::to_string(names.size() - 2) + " more";
  return out;
}

// The generation for the next save: above every one `dir` holds a trace
// of, so that no save reuses the name of a file a manifest may still name.
int64_t next_generation(const files::Directory& dir) {
  int64_t newest = 0;
  for (const std::string& name : dir.list())
    if (const std::optional<DataName> d = data_name(name)) newest = std::max(newest, d->generation);
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

// Whether `bytes` end as a file torch.save wrote ends: the zip archive's
// end record, with no comment, is its last 22 bytes. A file cut short
// fails this even where the zip reader, given the bytes it has, would not.
bool ends_as_torch_save_ends(const std::vector<char>& bytes) {
  constexpr size_t kEndRecord = 22;
  if (bytes.size() < kEndRecord) return false;
  const char* end = bytes.data() + bytes.size() - kEndRecord;
  return std::memcmp(end, "PK\x05\x06", 4) == 0 && end[20] == 0 && end[21] == 0;
}

// What a training file carries: its save's manifest (its own entry size
// 0), and whether that save was a first one. nullopt for a file of no such
// manifest (written before format 2), or not whole.
struct Carried {
  Manifest manifest;
  bool first_save = false;
};

std::optional<Carried> carried_by(const std::vector<char>& training, const std::string& path) {
  try {
    if (!ends_as_torch_save_ends(training)) return std::nullopt;
    const TensorDict t = deserialize(training, path);
    if (!t.contains(kEmbedded)) return std::nullopt;
    const torch::Tensor text = t.at(kEmbedded).to(torch::kUInt8).contiguous();
    return Carried{parse_manifest(std::string(reinterpret_cast<const char*>(text.data_ptr<uint8_t>()), text.numel()), path),
                   t.contains(kFirstSave) && t.at(kFirstSave).item<int64_t>() != 0};
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

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
  // A training file of format 2 carries its save's manifest: the manifest
  // must say what it says, whatever format it claims (one edited to format
  // 1, which has no checksum, says nothing else unchecked).
  const std::string training = m.files.at("training").name;
  if (const std::optional<Carried> c = carried_by(out.training, dir.path_of(training))) {
    const std::string where = dir.path_of(manifest_name) + " is damaged: ";
    if (m.format == 1) throw CheckpointError(where + "it says format 1, but its training file " + training + " was written in format 2");
    Manifest stated = m;
    stated.files["training"].size = 0;
    stated.files["training"].crc = 0;
    std::istringstream here(manifest_text(stated)), there(manifest_text(c->manifest));
    for (std::string a, b; std::getline(here, a) && std::getline(there, b);)
      if (a != b) throw CheckpointError(where + "it says '" + a + "' where its training file " + training + " says '" + b + "'");
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

// The training file `training` of generation `generation` as a lone file:
// whether what it carries says a first save wrote it.
bool lone_first_save(const files::Directory& dir, const std::string& training, int64_t generation) {
  try {
    const std::optional<Carried> c = carried_by(dir.read(training), dir.path_of(training));
    return c && c->first_save && c->manifest.generation == generation && c->manifest.files.at("training").name == training;
  } catch (const std::exception&) {
    return false;
  }
}

// The checkpoint the pair `model`, `training` holds, verified against the
// manifest its training file carries; nullopt where it does not verify.
// `first` says whether a first save wrote it.
std::optional<CheckpointFiles> verify_pair(const files::Directory& dir, const std::string& model,
                                           const std::string& training, int64_t generation, bool& first) {
  try {
    CheckpointFiles out;
    out.dir = dir.path();
    out.manifest_name = training;
    out.recovered = true;
    out.training = dir.read(training);
    std::optional<Carried> c = carried_by(out.training, dir.path_of(training));
    if (!c) return std::nullopt;
    Manifest& m = c->manifest;
    if (m.generation != generation || m.files.at("model").name != model || m.files.at("training").name != training)
      return std::nullopt;
    out.model = dir.read(model);
    if (out.model.size() != m.files.at("model").size || crc32_of(out.model.data(), out.model.size()) != m.files.at("model").crc)
      return std::nullopt;
    first = c->first_save;
    m.files["training"] = {training, out.training.size(), crc32_of(out.training.data(), out.training.size())};
    const std::string manifest = manifest_text(m);
    out.manifest.assign(manifest.begin(), manifest.end());
    return out;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// What a directory without a manifest holds: its model and training files;
// the newest pair of them that verifies and is no first save's; and, where
// there is none, whether every file is a first save's: a pair written where
// no manifest was, a lone training file that says it was, or a lone file of
// generation 1 or of one above a first save's (each save counts one above
// every file it finds), a directory with no trace of a save before it.
struct Unnamed {
  std::vector<std::string> files;
  std::optional<CheckpointFiles> newest;
  bool first_saves = true;
};

Unnamed examine(const files::Directory& dir) {
  Unnamed out;
  using Key = std::pair<int64_t, std::string>;  // generation, lineage
  std::map<Key, std::map<std::string, std::string>, std::greater<>> pairs;
  for (const std::string& name : dir.list())
    if (const std::optional<DataName> d = data_name(name)) {
      pairs[{d->generation, d->lineage}][d->role] = name;
      out.files.push_back(name);
    }
  std::sort(out.files.begin(), out.files.end());
  std::set<Key> first_pairs;
  for (const auto& [key, roles] : pairs) {  // the newest first
    bool first = false;
    std::optional<CheckpointFiles> pair;
    if (roles.size() == 2) pair = verify_pair(dir, roles.at("model"), roles.at("training"), key.first, first);
    if (pair && !first) {
      out.newest = std::move(pair);
      out.first_saves = false;
      return out;
    }
    if (pair) first_pairs.insert(key);
  }
  std::set<int64_t> first_generations;
  for (auto it = pairs.rbegin(); it != pairs.rend(); ++it) {  // the oldest first
    const auto& [key, roles] = *it;
    const bool lone_model = roles.size() == 1 && roles.count("model");
    const bool lone_training = roles.size() == 1 && roles.count("training");
    if (first_pairs.count(key) || key.first == 1 || (lone_model && first_generations.count(key.first - 1)) ||
        (lone_training && lone_first_save(dir, roles.at("training"), key.first)))
      first_generations.insert(key.first);
    else
      out.first_saves = false;
  }
  return out;
}

}  // namespace

std::string new_lineage() {
  std::random_device device;
  char text[16];
  std::snprintf(text, sizeof text, "%08x", device());
  return text;
}

void write_file_atomically(const std::string& path, const std::vector<char>& bytes) {
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  files::Directory::open(dir).write_atomically(path.substr(slash == std::string::npos ? 0 : slash + 1), bytes);
}

void save_checkpoint(const std::string& path, const Checkpoint& c,
                     const std::function<void(const std::string&)>& after_each_write) {
  auto done = [&](const std::string& what) {
    if (after_each_write) after_each_write(what);
  };
  const files::Directory dir = files::Directory::open_own(path, /*create=*/true);
  const bool first = !dir.has(kManifest) && !dir.has(kPrevious);
  std::set<std::string> retired = named_by(dir, kManifest);  // what this save may make unnamed
  for (const std::string& name : named_by(dir, kPrevious)) retired.insert(name);

  // Fresh names for every save: no file a manifest names is ever touched.
  Manifest m;
  m.generation = next_generation(dir);
  m.counters = static_cast<const CheckpointCounters&>(c);
  std::vector<std::string> written;
  auto write = [&](const std::string& role, const std::vector<char>& bytes) {
    const ManifestFile f{data_file(role, m.generation, c.lineage), bytes.size(), crc32_of(bytes.data(), bytes.size())};
    dir.write_atomically(f.name, bytes);
    written.push_back(f.name);
    m.files[role] = f;
    done("wrote " + f.name);
  };
  std::optional<Manifest> newest;
  try {
    write("model", serialize(c.model));
    // The training file carries the manifest so far, and whether this is a first save.
    m.files["training"] = {data_file("training", m.generation, c.lineage), 0, 0};
    const std::string so_far = manifest_text(m);
    TensorDict training = c.training.copy();
    torch::Tensor text = torch::empty({static_cast<int64_t>(so_far.size())}, torch::kUInt8);
    std::memcpy(text.data_ptr<uint8_t>(), so_far.data(), so_far.size());
    training.insert(kEmbedded, text);
    training.insert(kFirstSave, torch::tensor(static_cast<int64_t>(first)));
    write("training", serialize(training));
    // The newest checkpoint becomes the previous one only if it is whole: a
    // damaged newest (a run that resumed from the previous one) must not
    // push out the checkpoint that is. A kill between the two renames leaves
    // both manifests naming the same checkpoint.
    newest = intact(dir, kManifest);
    if (newest) dir.write_atomically(kPrevious, dir.read(kManifest));
    const std::string text_now = manifest_text(m);
    dir.write_atomically(kManifest, std::vector<char>(text_now.begin(), text_now.end()));
  } catch (...) {
    for (const std::string& name : written) dir.remove(name);  // no manifest names them
    throw;
  }
  dir.sync();
  done("wrote manifest");

  // What this save knows for its own (see "Note on whose files") and
  // neither manifest names now.
  std::set<std::string> keep{kManifest, kPrevious};
  for (const auto& [role, f] : m.files) keep.insert(f.name);
  const std::optional<Manifest> previous = newest ? newest : intact(dir, kPrevious);
  if (previous)
    for (const auto& [role, f] : previous->files) keep.insert(f.name);
  for (const auto& name : dir.list())
    if (!keep.count(name) && (retired.count(name) || of_lineage(name, c.lineage) || planted(dir, name))) dir.remove(name);
  done("removed stale files");
}

bool has_checkpoint(const std::string& dir) {
  return files::exists(files::join(dir, kManifest)) || files::exists(files::join(dir, kPrevious));
}

std::optional<std::vector<std::string>> first_saves_cut_short(const std::string& path) {
  const files::Directory dir = files::Directory::open(path);
  if (dir.has(kManifest) || dir.has(kPrevious)) return std::nullopt;
  Unnamed found = examine(dir);
  if (found.newest || !found.first_saves) return std::nullopt;
  return found.files;
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
    Unnamed found = examine(dir);
    if (found.newest) {
      const Manifest m = parse_manifest(std::string(found.newest->manifest.begin(), found.newest->manifest.end()), path);
      found.newest->fallback = path + " has no manifest: resuming from " + m.files.at("model").name + " and " +
                               m.files.at("training").name + ", the newest pair of its files whose contents verify (step " +
                               std::to_string(m.counters.step) + "); the other files are left as they are";
      return std::move(*found.newest);
    }
    const std::string none = "no checkpoint in " + path + ": it has no manifest";
    if (found.files.empty()) {
      const auto other = checkpoint_leftovers(path);
      throw CheckpointError(none + (other.empty() ? std::string(" (it is empty)") : ", only " + some_of(other)));
    }
    if (found.first_saves)
      throw CheckpointError(none + ", only " + some_of(found.files) + " (a first save cut short before its manifest)");
    throw CheckpointError(none + ", and no pair of its files " + some_of(found.files) + " verifies: nothing resumes "
                          "from them and nothing deletes them; move them away, or start afresh beside them with "
                          "--resume never");
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
  for (const char* key : {kEmbedded, kFirstSave}) static_cast<void>(c.training.erase(key));
  if (!f.recovered)
    if (const std::optional<DataName> d = data_name(m.files.at("model").name)) c.lineage = d->lineage;
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
