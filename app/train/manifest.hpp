// A checkpoint's manifest (checkpoint.hpp): the text file that holds a
// save's counters and arguments and names its data files, each with its
// size and CRC32, and ends with a CRC32 of its own:
//
//   mnist_ddp checkpoint 2
//   generation 7
//   epoch 3
//   ...
//   file model model-7.pt 4800763 1a2b3c4d
//   file training training-7.pt 9601234 5e6f7a8b
//   arg batch_size 32
//   checksum 0badf00d          (CRC32 of every byte before this line)
//
// Parsing is strict: every line known, every number whole and in range,
// every counter present, the checksum last and matching. So a flipped digit
// or a manifest cut short is a CheckpointError saying so, never a position
// read wrong. Format 1 (no checksum, written before it existed) is still read.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace mnist_ddp {

// A checkpoint that cannot be used: missing, truncated, corrupt or foreign.
struct CheckpointError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Where a checkpoint stands, and what it was written with.
struct CheckpointCounters {
  int64_t epoch = 0;         // the epoch to continue in
  int64_t batch = 0;         // batches of that epoch already trained (0 at an epoch boundary)
  int64_t step = 0;          // training steps finished
  double best_accuracy = 0;  // best test top-1 so far, in percent
  int world_size = 1;
  std::string compression;
  std::vector<std::pair<std::string, std::string>> arguments;  // the run's options
};

struct ManifestFile {
  std::string name;  // in the checkpoint's directory
  uint64_t size = 0;
  uint32_t crc = 0;
};

struct Manifest {
  int format = 2;          // as read: 1 for a manifest of no checksum
  int64_t generation = 0;  // one more than the save's before it
  CheckpointCounters counters;
  std::map<std::string, ManifestFile> files;  // by role: "model", "training"
};

// The manifest's text, checksum included.
std::string manifest_text(const Manifest& m);

// Parses and verifies `text`; `where` names it in errors ("<dir>/manifest").
// Throws CheckpointError saying what is wrong.
Manifest parse_manifest(const std::string& text, const std::string& where);

// CRC32 (zlib's) of `n` bytes.
uint32_t crc32_of(const char* data, size_t n);

}  // namespace mnist_ddp
