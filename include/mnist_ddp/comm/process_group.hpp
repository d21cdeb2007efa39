// A process group: who this rank is in the job, where its tensors live, and
// its way to the other ranks.
//
// init_process_group() reads the launcher that started this process (our
// launcher, torchrun, srun, mpirun, mpiexec, a Kubeflow pod) from the
// environment; a process that no launcher started is a world of 1. The rank
// joins the job's store, agrees on its rank, checks its settings against
// rank 0's, and forms its groups: Gloo (CPU tensors, or CUDA tensors when
// ranks share a GPU) or NCCL (CUDA, where the LibTorch has it). Every
// collective of a rank goes through one of its ordered streams, so every
// rank issues them in the same order (docs/design.md).
//
// A ProcessGroup is a handle: copies share one group, which lives as long as
// any of them does (or a model holding a SyncBatchNorm over it). A group of
// world size 1 behaves like any other, so training code never asks whether
// it is distributed.
//
// Thread safety: the accessors are safe from any thread. The collectives
// below may be called from any thread, but every rank must issue the same
// collectives in the same order, so a program calls them from one thread
// (or orders its threads itself).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <torch/arg.h>

#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mnist_ddp {

// Settings every rank of a job must share, as (name, value).
using Settings = std::vector<std::pair<std::string, std::string>>;

// A future of a collective's result (a communication hook returns one).
using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;
// A future that is already complete with `tensor`.
FuturePtr completed_future(const at::Tensor& tensor);

struct ProcessGroupOptions {
  // "auto": NCCL when this rank's device is a GPU, Gloo otherwise; or
  // "gloo" (CPU tensors, or CUDA tensors of ranks sharing a GPU), "nccl".
  TORCH_ARG(std::string, backend) = "auto";
  // This rank's device; nullopt: the one our launcher planned for it, else
  // GPU LOCAL_RANK where CUDA sees GPUs (the only one where it sees one),
  // else the CPU.
  TORCH_ARG(std::optional<c10::Device>, device) = std::nullopt;
  // How long joining the job, and any collective, may wait. Unset: the
  // --timeout of the `mnist_ddp run` that started this process, else 5
  // minutes.
  TORCH_ARG(std::optional<std::chrono::milliseconds>, timeout) = std::nullopt;
  // The store's address and port where the launcher leaves them open
  // (mpirun or mpiexec without MASTER_ADDR and MASTER_PORT): by default
  // 127.0.0.1 on one host, and a port that follows the MPI job or 29500.
  TORCH_ARG(std::string, master_addr) = "";
  TORCH_ARG(int, master_port) = 0;
  // What every rank must agree on (a model's size, a learning rate):
  // compared with rank 0's while joining; a difference is one error naming
  // the setting and both values.
  TORCH_ARG(Settings, settings) = {};
  // Check every collective against every rank's before it is issued (under
  // NCCL: beside it), so that ranks issuing different ones end in one line
  // naming each (docs/library.md, "What is checked"). Off: collectives go
  // out as issued, a mismatch hangs until the timeout or aborts in the
  // backend, and ddp.join() is refused; it is there to measure what the
  // check costs.
  TORCH_ARG(bool, check_collectives) = true;
};

// A collective of the program's own in flight, as c10d's Work (PyTorch's
// async_op=True): the program computes while it travels.
class Work {
 public:
  // Blocks until the collective has completed; throws its failure (an
  // mnist_ddp::Error).
  void wait() const;
  // Blocks at most `timeout`: true once the collective has completed (its
  // failure thrown, as wait()), false while it is still in flight.
  bool wait(std::chrono::milliseconds timeout) const;
  bool is_completed() const;
  // Completed without a failure.
  bool is_success() const;
  // Its failure (an mnist_ddp::Error) once it failed; null otherwise.
  std::exception_ptr exception() const;
  // Completes with the collective's result (its tensor; allgather's
  // stacked tensor), or with its failure.
  FuturePtr get_future() const;

  // The library's own: an incomplete type to a program.
  struct State;

 private:
  friend struct GroupAccess;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

class ProcessGroup {
 public:
  int rank() const;
  int world_size() const;
  // This rank's place among the ranks of its machine.
  int local_rank() const;
  int local_world_size() const;
  const c10::Device& device() const;
  const std::string& backend() const;  // "gloo" or "nccl"
  std::chrono::milliseconds timeout() const;
  // Which start of the job's workers this is: 0, then one more per restart
  // (our launcher's --max-restarts, torchrun's, a requeued Slurm job's),
  // the same on every rank.
  int restart() const;
  // Which launcher started this process: "mnist_ddp", "torchrun", "slurm",
  // "mpirun", "mpiexec", "kubeflow", or "" for none (a world of 1).
  const std::string& launcher() const;

  // Collectives for the program's own use, on the stream of the
  // collectives computation waits on (SyncBatchNorm's, DDP's buffers),
  // in order with them. Every rank must call them in the same order with
  // tensors of the same shape and dtype, on device(). A mismatch with
  // another rank's collective is a CollectiveMismatch naming both
  // (docs/library.md). A tensor that is undefined, on another device, or
  // (where the collective writes into it) requires grad, or a root outside
  // the group, is a UsageError at the call. The _async forms return at
  // once, with a Work; the tensors must stay as they are until it
  // completes.
  void allreduce_sum(at::Tensor& tensor) const;
  Work allreduce_sum_async(at::Tensor& tensor) const;
  void broadcast(at::Tensor& tensor, int root = 0) const;
  Work broadcast_async(at::Tensor& tensor, int root = 0) const;
  // Every rank's `tensor`, stacked: [world_size, tensor's shape...].
  at::Tensor allgather(const at::Tensor& tensor) const;
  Work allgather_async(const at::Tensor& tensor) const;
  // `input` holds world_size() chunks of `output`'s size, one a rank (flat,
  // or stacked [world_size, output's shape...]); every rank's `output`
  // becomes the sum over the ranks of its own chunk.
  void reduce_scatter(at::Tensor& output, const at::Tensor& input) const;
  Work reduce_scatter_async(at::Tensor& output, const at::Tensor& input) const;
  void barrier() const;
  Work barrier_async() const;

  // Ends this rank's part in the group, as PyTorch's shutdown() does: a
  // collective still waiting (on a peer that is gone, or will not come)
  // fails at once with PeerLost, later ones are refused, and destroying the
  // group (or a DDP over it) waits for nothing. For a program that caught
  // a PeerLost or a Timeout and then returns from main() normally, or
  // forms the job's group anew (init_process_group()).
  void shutdown() const;

  // The group's state, the library's own: an incomplete type to a program.
  struct State;

 private:
  friend struct GroupAccess;
  explicit ProcessGroup(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

// Joins the job the launcher that started this process describes, or forms
// a world of 1 when none did. The group becomes the process's default
// (default_process_group()); a second call returns it when `options` ask
// for nothing it does not have, and throws UsageError naming the difference
// otherwise. Once it was shut down, or every handle to it is gone (PyTorch's
// destroy_process_group()), a call forms the job's group anew, with the
// same ranks over the same store: every rank calls it as often. Throws
// UsageError for an environment or options that cannot work, Timeout for a rank or store that does not answer within
// the timeout, PeerLost when the store's host went away, and Error with a
// one-line reason otherwise (port in use, a setting that differs).
ProcessGroup init_process_group(const ProcessGroupOptions& options = {});

// The group the process formed first, while any handle to it lives: the one
// SyncBatchNorm uses when nothing names another.
std::optional<ProcessGroup> default_process_group();

// A group of some of `group`'s ranks (PyTorch's new_group), with streams of
// its own: a DDP, a SyncBatchNorm or the program's own collectives may run
// over it. Its ranks are numbered in the order of `ranks`' sorted values.
// Collective: every rank of `group` calls it, with the same ranks (a
// difference is a UsageError on every rank); a rank not among them gets
// nullopt. UsageError for ranks that repeat or fall outside the group.
std::optional<ProcessGroup> new_group(const ProcessGroup& group, std::vector<int> ranks);

}  // namespace mnist_ddp
