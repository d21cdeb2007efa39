// MNIST-format data: IDX files held in memory, sharded across ranks, cut
// into batches.
//
// The whole set is decoded and normalised once, so a batch is one
// index_select per tensor: no per-sample work, no loader processes.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace mnist_ddp {

// A missing, truncated or malformed data file. what() names the file.
struct DataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Reads an IDX file of unsigned bytes with `dims` dimensions, raw or gzip
// (zlib reads both). Returns a uint8 tensor shaped as the file says.
torch::Tensor read_idx(const std::string& path, int dims);

struct Dataset {
  torch::Tensor images;  // float32 [N, 1, 28, 28]: (pixel / 255 - 0.1307) / 0.3081
  torch::Tensor labels;  // int64 [N], each in 0..9
  int64_t size() const { return labels.size(0); }
};

// Where fetch_data.sh puts a dataset: <data_dir>/MNIST/raw or
// <data_dir>/FashionMNIST/raw, torchvision's layout.
std::string raw_dir(const std::string& data_dir, const std::string& dataset);

// Checks that the train and test files exist and their headers agree,
// without decoding them. Throws DataError saying how to fetch the data.
void check_dataset_files(const std::string& data_dir, const std::string& dataset);

// The memory a worker holds for both splits once loaded, from the files'
// headers. Throws DataError as check_dataset_files does.
int64_t dataset_bytes(const std::string& data_dir, const std::string& dataset);

// Loads the training or test split and validates all of it: magic numbers,
// 28x28 images, equal image and label counts, labels in 0..9.
Dataset load_dataset(const std::string& data_dir, const std::string& dataset, bool train);

// PyTorch's DistributedSampler: each epoch a permutation of 0..size-1 drawn
// from a generator seeded with seed + epoch (identical on every rank),
// padded by repeating its head to a multiple of world_size, of which rank
// takes every world_size-th element from position rank. Every rank gets the
// same number of samples.
class DistributedSampler {
 public:
  DistributedSampler(int64_t size, int world_size, int rank, bool shuffle, uint64_t seed);
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t num_samples() const { return num_samples_; }
  // This rank's indices for the current epoch: int64 [num_samples()].
  torch::Tensor indices() const;

 private:
  int64_t size_;
  int world_size_;
  int rank_;
  bool shuffle_;
  uint64_t seed_;
  int64_t epoch_ = 0;
  int64_t num_samples_;
};

// Indices rank, rank + world_size, ...: every sample on exactly one rank, no
// padding, so a sum over ranks counts each test image once.
torch::Tensor shard_indices(int64_t size, int world_size, int rank);

int64_t num_batches(int64_t samples, int64_t batch_size);

// Batch `b` of the samples at `indices` (the last batch may be short), as
// (images, labels).
std::pair<torch::Tensor, torch::Tensor> get_batch(const Dataset& data, const torch::Tensor& indices, int64_t b,
                                                  int64_t batch_size);

}  // namespace mnist_ddp
