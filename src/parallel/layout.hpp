// The buckets of one DistributedDataParallel: which parameters each holds,
// in which order, and the flat buffer each parameter's gradient is a view
// into. Pure: no communication, no autograd. Not installed.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "mnist_ddp/parallel/comm_hooks.hpp"

namespace mnist_ddp {

// Groups tensors, given in bucket order with their sizes in bytes and a
// kind each (their dtype: tensors of two kinds never share a bucket), into
// buckets: a bucket of a kind closes once it holds at least its cap, which
// is `first_cap_bytes` for the first bucket of each kind and `cap_bytes`
// after. Buckets are ordered by their first tensor. Returns the tensor
// indices of each bucket. `kinds` empty: all of one kind. Pure.
std::vector<std::vector<size_t>> compute_bucket_assignment(const std::vector<int64_t>& sizes_bytes,
                                                           int64_t first_cap_bytes, int64_t cap_bytes,
                                                           const std::vector<int>& kinds = {});

// A parameter a DDP averages.
struct AveragedParam {
  torch::Tensor tensor;
  std::string name;     // "fc.weight", as the model names it
  bool sparse = false;  // its gradient is sparse (an Embedding's with sparse(true)): a bucket of its own
};

class BucketLayout {
 public:
  // Buckets over `params` taken in `order` (the first bucket's first
  // parameter first): one dtype a bucket (a complex parameter's bucket
  // holds reals), a sparse parameter alone, without a buffer. Caps in bytes.
  BucketLayout(const std::vector<AveragedParam>& params, const std::vector<size_t>& order, int64_t first_cap_bytes,
               int64_t cap_bytes);

  size_t size() const { return buckets_.size(); }
  const std::vector<hooks::GradBucket>& buckets() const { return buckets_; }
  const hooks::GradBucket& bucket(size_t b) const { return buckets_[b]; }
  size_t bucket_of(size_t param) const { return bucket_of_[param]; }
  // How many parameters bucket `b` holds.
  size_t params_in(size_t b) const { return counts_[b]; }
  // Parameter `p`'s gradient as a view into its bucket (undefined for a sparse one).
  const torch::Tensor& view(size_t p) const { return views_[p]; }
  // The parameters in bucket order, as given.
  const std::vector<size_t>& order() const { return order_; }

  // Where a parameter's .grad is a view into `old`'s bucket, its value
  // moves into this layout's view and .grad becomes that view.
  void adopt_gradients(const std::vector<AveragedParam>& params, const BucketLayout& old) const;
  // One line per bucket: index, parameters, elements, bytes, names.
  std::vector<std::string> describe() const;

 private:
  std::vector<size_t> order_;
  std::vector<hooks::GradBucket> buckets_;
  std::vector<size_t> counts_;      // bucket -> its parameters
  std::vector<size_t> bucket_of_;   // param -> bucket
  std::vector<torch::Tensor> views_;  // param -> view into its bucket
};

}  // namespace mnist_ddp
