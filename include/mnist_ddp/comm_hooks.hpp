// Communication hooks: how DDP averages a bucket of gradients across ranks.
//
// The interface is PyTorch's: a hook receives a GradBucket holding this
// rank's gradients (NOT yet divided by the world size) and returns a future
// of a tensor shaped like the bucket that holds the average. DDP runs hooks
// on its communication thread, one bucket at a time and in bucket order on
// every rank, so a hook may wait on its own collectives; see ddp.hpp.
//
// Hooks talk to the other ranks only through a Wire. The fp16 wrapper hands
// the hook it wraps a wire that sends float16, so it composes with any hook
// while the hook itself computes in float32.
#pragma once

#include <torch/torch.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mnist_ddp/dist.hpp"

namespace mnist_ddp {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

struct GradBucket {
  size_t index = 0;     // position in launch order
  bool is_last = false; // the last bucket of a step: per-step state advances here
  torch::Tensor buffer; // flat, this rank's gradients, not divided by world size
  std::vector<torch::Tensor> gradients;  // views into buffer, shaped as the parameters
};

// A future that is already complete with `tensor`.
FuturePtr completed_future(const torch::Tensor& tensor);

// The tensor a hook's future completed with (a Tensor, or a list of one).
torch::Tensor future_tensor(const FuturePtr& future);

// The collective a hook uses. Both calls work in place on `tensor` and
// complete their future with it.
class Wire {
 public:
  virtual ~Wire() = default;
  virtual int world_size() const = 0;
  virtual FuturePtr allreduce_sum(torch::Tensor tensor) = 0;
  // Sum of tensor / world_size: dividing first keeps float16 sums finite.
  virtual FuturePtr allreduce_mean(torch::Tensor tensor);
};

// The wire of a process group. Counts what this rank sends, per element and
// per byte, as `elements x element size` of each allreduce.
class GroupWire : public Wire {
 public:
  explicit GroupWire(GroupPtr group) : group_(std::move(group)) {}
  int world_size() const override { return group_->getSize(); }
  FuturePtr allreduce_sum(torch::Tensor tensor) override;
  int64_t elements_sent() const { return elements_; }
  int64_t bytes_sent() const { return bytes_; }

 private:
  GroupPtr group_;
  int64_t elements_ = 0;
  int64_t bytes_ = 0;
};

// Puts float16 on the wire below it: tensors are cast down before and back
// after; a mean is divided by the world size in float32 before the cast.
class Fp16Wire : public Wire {
 public:
  explicit Fp16Wire(Wire& below) : below_(below) {}
  int world_size() const override { return below_.world_size(); }
  FuturePtr allreduce_sum(torch::Tensor tensor) override;
  FuturePtr allreduce_mean(torch::Tensor tensor) override;

 private:
  FuturePtr send_half(torch::Tensor tensor, torch::Tensor half);
  Wire& below_;
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  // The --compression name.
  virtual std::string name() const = 0;
  virtual FuturePtr run(GradBucket& bucket, Wire& wire) = 0;
  // Whether this step's buckets were compressed (false for `none`, and for
  // PowerSGD before its start iteration).
  virtual bool compressing() const { return false; }
};

// none: allreduce of the bucket, divided by world size.
class AllreduceHook : public CommHook {
 public:
  std::string name() const override { return "none"; }
  FuturePtr run(GradBucket& bucket, Wire& wire) override;
};

// Runs `inner` with float16 on the wire.
class Fp16Wrapper : public CommHook {
 public:
  explicit Fp16Wrapper(std::unique_ptr<CommHook> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name() == "none" ? "fp16" : inner_->name() + "_fp16"; }
  FuturePtr run(GradBucket& bucket, Wire& wire) override;
  bool compressing() const override { return true; }
  CommHook& inner() { return *inner_; }

 private:
  std::unique_ptr<CommHook> inner_;
};

// The hook for a --compression value.
std::unique_ptr<CommHook> make_comm_hook(const std::string& compression);

}  // namespace mnist_ddp
