// Files a run leaves behind, written so that a kill at any instant leaves
// either the previous file or the new one, never a torn one.
//
// A checkpoint directory holds:
//   manifest              text (manifest.hpp); names the files below with
//                         their sizes and CRC32s, holds the run's counters
//                         and arguments, and ends with a CRC32 of its own
//   model-<N>.pt          the model's state dict, as Python's torch.save
//                         writes it ("module.conv1.weight", ...)
//   training-<N>.pt       everything else a resumed run needs, as a dict of
//                         tensors: optimizer momentum, every rank's RNG and
//                         hook state
//   manifest.previous     the manifest of the checkpoint before, whose
//                         files stay until the next save
// N is the save's generation, above any the directory holds a trace of.
// The data files are written first, under names no manifest refers to
// yet; the old manifest becomes manifest.previous (only if its checkpoint
// is whole: a damaged newest never pushes out an intact previous one); the
// new one is renamed into place last; then files neither manifest refers
// to are removed. Every file is written through files::Directory: created
// exclusively under an unguessable name, never through a symbolic link.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "app/train/manifest.hpp"

namespace mnist_ddp {

using TensorDict = c10::Dict<std::string, torch::Tensor>;

// A checkpoint: its counters and arguments (manifest.hpp), and its tensors.
struct Checkpoint : CheckpointCounters {
  TensorDict model;     // state dict, "module." names
  TensorDict training;  // see above; "rank/<r>/..." entries belong to rank r
};

// Writes `checkpoint` into `dir`, creating it; `dir` must be this user's
// and not a symbolic link. `after_each_write`, if given, is called with a
// description after each file operation (tests use it to interrupt a
// save). Throws std::runtime_error naming the file.
void save_checkpoint(const std::string& dir, const Checkpoint& checkpoint,
                     const std::function<void(const std::string&)>& after_each_write = nullptr);

// Whether `dir` holds a manifest or a previous manifest: a checkpoint to
// resume from, or to say why not.
bool has_checkpoint(const std::string& dir);

// What `dir` holds besides manifests, sorted: for a directory without a
// manifest, the leftovers of a first save cut short before its manifest.
std::vector<std::string> checkpoint_leftovers(const std::string& dir);

// A checkpoint's files as they are on disk: what rank 0 reads and sends to
// the other ranks, so that every rank parses the same bytes.
struct CheckpointFiles {
  std::string dir;
  std::string manifest_name = "manifest";  // or "manifest.previous"
  std::vector<char> manifest, model, training;
  std::string fallback;  // why the newest checkpoint was passed over; "" when it was not
};

// Reads `dir`'s newest checkpoint, verifying each file against the
// manifest's size and CRC32; when that fails, or the newest has no
// manifest, and the previous checkpoint verifies, that one, saying why in
// `fallback`. Throws CheckpointError saying what is wrong (with both).
CheckpointFiles read_checkpoint_files(const std::string& dir);

// Parses files read by read_checkpoint_files. Throws CheckpointError.
Checkpoint parse_checkpoint(const CheckpointFiles& files);

// The counters and arguments of the checkpoint read_checkpoint_files
// would take from `dir`, nullopt when none verifies. Creates no tensor:
// the launcher calls it between forks.
std::optional<Checkpoint> read_manifest(const std::string& dir);

// read_checkpoint_files, then parse_checkpoint.
Checkpoint load_checkpoint(const std::string& dir);

// The module's state as Python's Module.state_dict() lists it: each
// module's parameters, then its buffers, then its children, depth first;
// names joined with '.' after `prefix`. Tensors are detached CPU copies.
TensorDict state_dict(const torch::nn::Module& module, const std::string& prefix = "");

// Copies `state` (names `prefix` + the module's own) into `module`'s
// parameters and buffers. Throws CheckpointError, naming `what`, unless the
// names and shapes match exactly.
void load_state_dict(torch::nn::Module& module, const TensorDict& state, const std::string& prefix,
                     const std::string& what);

// A dict of tensors in the format of Python's torch.save, so that
// torch.load(path) returns the dict, and back.
std::vector<char> serialize(const TensorDict& state);
TensorDict deserialize(const std::vector<char>& bytes, const std::string& what);

}  // namespace mnist_ddp
