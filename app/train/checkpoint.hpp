// Files a run leaves behind, written so that a kill at any instant leaves
// either the previous file or the new one, never a torn one.
//
// A checkpoint directory holds:
//   manifest              text (manifest.hpp); names the files below with
//                         their sizes and CRC32s, holds the run's counters
//                         and arguments, and ends with a CRC32 of its own
//   model-<N>-<L>.pt      the model's state dict, as Python's torch.save
//                         writes it ("module.conv1.weight", ...)
//   training-<N>-<L>.pt   everything else a resumed run needs, as a dict of
//                         tensors: optimizer momentum, every rank's RNG and
//                         hook state; and the save's manifest as it stands
//                         before this file (its counters, the model file's
//                         size and CRC32), so that a pair outlives a lost
//                         manifest (read_checkpoint_files)
//   manifest.previous     the manifest of the checkpoint before, whose
//                         files stay until the next save
// N is the save's generation, above any the directory holds a trace of;
// L the checkpoint's lineage: drawn by a run that starts afresh, kept by
// one that resumes from a manifest (files written before lineages have
// none: model-<N>.pt). The data files are written first, under names no
// manifest refers to yet; the old manifest becomes manifest.previous (only
// if its checkpoint is whole: a damaged newest never pushes out an intact
// previous one); the new one is renamed into place last.
//
// Note on whose files: a save then removes only what it knows is its
// own: the files a manifest named that no manifest names any longer, and
// the files (and temporary files) of its lineage that neither names, left
// by saves cut short; and symbolic links planted under such names. Files
// of another lineage, or of none (a run's always has one), stay whatever
// they are. Every file is written through files::Directory:
// created exclusively under an unguessable name, never through a symbolic
// link; a save that fails removes what it wrote.
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
  // The lineage its files carry (see above): where read from a manifest,
  // its model file's; "" for files of no lineage, or recovered without one.
  std::string lineage;
};

// A lineage for a run that starts afresh: 8 random hex digits.
std::string new_lineage();

// Writes `checkpoint` into `dir`, creating it; `dir` must be this user's
// and not a symbolic link. `after_each_write`, if given, is called with a
// description after each file operation (tests use it to interrupt a
// save). Throws std::runtime_error naming the file.
void save_checkpoint(const std::string& dir, const Checkpoint& checkpoint,
                     const std::function<void(const std::string&)>& after_each_write = nullptr);

// Whether `dir` holds a manifest or a previous manifest: a checkpoint to
// resume from, or to say why not.
bool has_checkpoint(const std::string& dir);

// What `dir` holds besides manifests, sorted.
std::vector<std::string> checkpoint_leftovers(const std::string& dir);

// For a directory without a manifest whose model and training files, if
// any, are all leftovers of first saves cut short before their manifest (a
// pair written where no manifest was, or a lone file of generation 1):
// those files, nothing to resume from and nothing of another checkpoint.
// nullopt for any other directory. Throws std::runtime_error where `dir`
// cannot be opened.
std::optional<std::vector<std::string>> first_saves_cut_short(const std::string& dir);

// A checkpoint's files as they are on disk: what rank 0 reads and sends to
// the other ranks, so that every rank parses the same bytes.
struct CheckpointFiles {
  std::string dir;
  std::string manifest_name = "manifest";  // or "manifest.previous"
  std::vector<char> manifest, model, training;
  std::string fallback;  // why the newest checkpoint was passed over; "" when it was not
  bool recovered = false;  // read without a manifest, from the manifest its training file holds
};

// Reads `dir`'s newest checkpoint, verifying each file against the
// manifest's size and CRC32; when that fails, or the newest has no
// manifest, and the previous checkpoint verifies, that one, saying why in
// `fallback`. In a directory without either manifest, the newest pair of
// files whose contents verify (not a first save's), saying so in
// `fallback`. Throws CheckpointError saying what is wrong (with both), or,
// where no pair verifies, naming the files and the ways out.
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
