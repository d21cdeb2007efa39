// Communication hooks: how DDP averages a bucket of gradients across ranks.
//
// The interface is PyTorch's: a hook receives a GradBucket holding this
// rank's gradients (NOT yet divided by the world size) and returns a future
// of a tensor shaped like the bucket that holds the average. DDP runs hooks
// as tasks of the ordered collective stream, one bucket at a time and in
// bucket order on every rank, so a hook may wait on its own collectives; see
// ddp.hpp and collectives.hpp.
//
// Hooks talk to the other ranks only through a Wire. The fp16 wrapper hands
// the hook it wraps a wire that sends float16, so it composes with any hook
// while the hook itself computes in float32.
#pragma once

#include <torch/torch.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mnist_ddp/comm/collectives.hpp"
#include "mnist_ddp/base/options.hpp"

namespace mnist_ddp {

// A hook's state between steps, as named tensors, for checkpoints.
struct HookState {
  std::map<std::string, torch::Tensor> shared;  // identical on every rank
  std::map<std::string, torch::Tensor> own;     // this rank's alone (PowerSGD's error feedback)
  bool empty() const { return shared.empty() && own.empty(); }
};

struct GradBucket {
  size_t index = 0;     // position in launch order
  bool is_last = false; // the last bucket of a step: per-step state advances here
  torch::Tensor buffer; // flat, this rank's gradients, not divided by world size
  // Views into buffer, shaped as the parameters, lying in order without gaps.
  std::vector<torch::Tensor> gradients;
};

// The gradients' shapes laid over `flat`, a tensor of the bucket's size.
std::vector<torch::Tensor> same_layout(const GradBucket& bucket, const torch::Tensor& flat);

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

// What a rank has sent: `elements x element size` of each allreduce.
struct WireStats {
  int64_t elements = 0;
  int64_t bytes = 0;
};

// The wire of the collective stream's channel, for use inside a task.
// Counts what it sends into `stats`.
//
// Note on the link. Without shared memory, a float16 tensor of 64 Ki
// elements or more on the CPU goes round a ring of point-to-point transfers
// that adds in float32: Gloo's own allreduce adds float16 one element at a
// time, which made the fp16 hook slower than sending float32. The ring sends
// pieces of kLinkPieceBytes, kLinkPiecesInFlight at a time, not a whole
// chunk per exchange: over a shaped link that took fp16 from 326 to 214
// ms/step at 100 Mbit/s and from 54 to 46 at 1 Gbit/s (docs/performance.md;
// the link's queue peaked at about 0.4 MB either way, so why was not pinned
// down). Everything else, float32 buckets included, goes to Gloo's
// allreduce, asynchronously: the same pieced ring for float32 was 5% faster
// at 1 Gbit/s but 22% slower unshaped (44 against 36 ms/step), its pieces
// costing the one core a node has there more than they saved.
constexpr int64_t kLinkPieceBytes = 256 * 1024;
constexpr int kLinkPiecesInFlight = 2;

class GroupWire : public Wire {
 public:
  GroupWire(Channel& channel, WireStats& stats) : channel_(channel), stats_(stats) {}
  int world_size() const override { return channel_.world_size(); }
  FuturePtr allreduce_sum(torch::Tensor tensor) override;

 private:
  void ring_allreduce(torch::Tensor& tensor);

  Channel& channel_;
  WireStats& stats_;
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
  // Whether the coming step compresses as fully as this hook ever will
  // (false during PowerSGD's plain-allreduce warm-up).
  virtual bool compression_started() const { return true; }
  virtual HookState state() const { return {}; }
  virtual void load_state(const HookState& state) {}
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
  bool compression_started() const override { return inner_->compression_started(); }
  HookState state() const override { return inner_->state(); }
  void load_state(const HookState& state) override { inner_->load_state(state); }

 private:
  std::unique_ptr<CommHook> inner_;
};

// What PowerSGD remembers between steps; the two PowerSGD hooks share it.
struct PowerSgdState {
  explicit PowerSgdState(const PowerSgdOptions& options) : options(options) {}

  // A fresh seed for drawing Q, the same sequence on every rank.
  uint64_t next_seed();
  // Counts a step; call on its last bucket.
  void finish_step();
  HookState save() const;
  void load(const HookState& state);

  PowerSgdOptions options;
  int64_t iter = 0;       // steps finished
  uint64_t draws = 0;     // seeds drawn so far
  std::map<size_t, torch::Tensor> error;     // bucket -> this rank's compression error
  std::map<size_t, torch::Tensor> p_memory;  // bucket -> flat P of every compressed matrix
  std::map<size_t, torch::Tensor> q_memory;  // bucket -> flat Q, reused when warm-starting
};

// Note on exact math. What a rank computes from a collective's result and
// keeps (the averaged gradient, so the parameters) must come out
// bit-identical on every rank, whatever its thread count, CPU or GPU model.
// Matrix products and ATen's reductions do not promise that: they split the
// work, and so the rounding, by thread count and device. Elementwise
// operations do: IEEE rounds each one exactly. So the math that follows a
// collective uses elementwise operations only, and its sums are pairwise
// trees of elementwise adds whose shape depends on the size alone.

// The sum of the rows of `a` [n, k], as [k]: exact in the sense above.
torch::Tensor exact_row_sum(const torch::Tensor& a);

// out [n, m] = p [n, r] q [m, r]^T: r outer products added in order, exact
// in the sense above.
void exact_outer_product(torch::Tensor out, const torch::Tensor& p, const torch::Tensor& q);

// Gram-Schmidt on the columns of `matrix` [n, r], in place. A column of
// zeros stays zeros (no division by a zero norm); epsilon is added to each
// norm as PyTorch does. `exact` in the sense above, as P after its allreduce
// needs; Q is orthogonalised before it meets the data, and only the
// allreduced P = M Q depends on it, so it may take ATen's faster sums (on a
// GPU, a tree is a dozen kernel launches per column).
enum class Sums { kExact, kFast };
void orthogonalize(torch::Tensor& matrix, double epsilon, Sums sums = Sums::kExact);

// What both PowerSGD hooks share: their state, and plain allreduces until
// start_iter; then compress() averages the bucket in place.
class PowerSgdBase : public CommHook {
 public:
  FuturePtr run(GradBucket& bucket, Wire& wire) final;
  bool compression_started() const override { return state_.iter >= state_.options.start_iter; }
  HookState state() const override { return state_.save(); }
  void load_state(const HookState& state) override { state_.load(state); }

 protected:
  explicit PowerSgdBase(const PowerSgdOptions& options) : state_(options) {}
  virtual void compress(GradBucket& bucket, Wire& wire) = 0;
  PowerSgdState state_;
};

// powersgd: per bucket, error feedback; each gradient seen as an n x m
// matrix (n = its first dimension) is compressed to P [n, r] and Q [m, r]
// when (n + m) r min_compression_rate < n m; all other gradients go
// uncompressed in one allreduce, all P in one, all Q in one.
class PowerSgdHook : public PowerSgdBase {
 public:
  explicit PowerSgdHook(const PowerSgdOptions& options) : PowerSgdBase(options) {}
  std::string name() const override { return "powersgd"; }

 private:
  void compress(GradBucket& bucket, Wire& wire) override;
};

// batched_powersgd: the whole bucket as one square matrix of side
// ceil(sqrt(N)), zero-padded, compressed to P and Q of that side. Works on a
// padded copy, so the bucket itself never changes size (PyTorch resizes it,
// which is where its batched hook fails).
class BatchedPowerSgdHook : public PowerSgdBase {
 public:
  explicit BatchedPowerSgdHook(const PowerSgdOptions& options) : PowerSgdBase(options) {}
  std::string name() const override { return "batched_powersgd"; }

 private:
  void compress(GradBucket& bucket, Wire& wire) override;
};

// The hook for a --compression value.
std::unique_ptr<CommHook> make_comm_hook(const std::string& compression, const PowerSgdOptions& powersgd);

}  // namespace mnist_ddp
