// The wires the library hands its hooks: a stream's channel, and a 16-bit
// float wire over another. Not installed.
#pragma once

#include <c10/core/ScalarType.h>

#include "mnist_ddp/parallel/comm_hooks.hpp"
#include "comm/collectives.hpp"

namespace mnist_ddp::hooks {

// The wire of a collective stream's channel, for use inside a task.
// Counts what it sends into `stats`.
class GroupWire : public Wire {
 public:
  GroupWire(Channel& channel, WireStats& stats) : channel_(channel), stats_(stats) {}
  int rank() const override { return channel_.rank(); }
  int world_size() const override { return channel_.world_size(); }
  FuturePtr allreduce_sum(at::Tensor tensor) override;
  FuturePtr allgather(const at::Tensor& tensor) override;
  FuturePtr broadcast(at::Tensor tensor, int root) override;

 private:
  void count(const at::Tensor& tensor);
  Channel& channel_;
  WireStats& stats_;
};

// Puts `type` (float16 or bfloat16) on the wire below it: tensors are cast
// down before and back after; a mean is divided by the world size in the
// tensor's own precision before the cast.
class CastWire : public Wire {
 public:
  CastWire(Wire& below, c10::ScalarType type) : below_(below), type_(type) {}
  int rank() const override { return below_.rank(); }
  int world_size() const override { return below_.world_size(); }
  FuturePtr allreduce_sum(at::Tensor tensor) override;
  FuturePtr allreduce_mean(at::Tensor tensor) override;
  FuturePtr allgather(const at::Tensor& tensor) override;
  FuturePtr broadcast(at::Tensor tensor, int root) override;

 private:
  // Whether `tensor` is a floating-point one this wire lowers (indices and
  // other integers travel as they are).
  bool lowers(const at::Tensor& tensor) const;
  Wire& below_;
  c10::ScalarType type_;
};

}  // namespace mnist_ddp::hooks
