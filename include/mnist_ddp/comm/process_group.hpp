// A process group: who this rank is in the job, where its tensors live, and
// its ways to the other ranks.
//
// init_process_group() reads the launcher that started this process (our
// launcher, torchrun, srun, mpirun, mpiexec, a Kubeflow pod) from the
// environment; a process that no launcher started is a world of 1. The rank
// joins the job's store (store.hpp), agrees on its rank, checks its
// settings against rank 0's, and forms its groups: c10d::ProcessGroupGloo
// (CPU, or CUDA tensors when ranks share a GPU) or c10d::ProcessGroupNCCL
// (CUDA, when LibTorch has it). Every collective goes through one of the
// group's ordered streams (collectives.hpp).
//
// A ProcessGroup is a handle: copies share one group, which lives as long as
// any of them (or a model holding a SyncBatchNorm over it). A group of world
// size 1 behaves like any other, so training code never asks whether it is
// distributed. Not thread-safe, except where collectives.hpp says.
#pragma once

#include <torch/torch.h>
#include <torch/arg.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mnist_ddp/base/environment.hpp"
#include "mnist_ddp/comm/collectives.hpp"
#include "mnist_ddp/comm/store.hpp"

namespace mnist_ddp {

// Settings every rank of a job must share, as (name, value).
using Settings = std::vector<std::pair<std::string, std::string>>;

struct ProcessGroupOptions {
  // "auto": NCCL when this rank's device is a GPU, Gloo otherwise; or
  // "gloo" (CPU tensors, or CUDA tensors of ranks sharing a GPU), "nccl".
  TORCH_ARG(std::string, backend) = "auto";
  // This rank's device; nullopt: the one our launcher planned for it, else
  // GPU LOCAL_RANK where CUDA sees GPUs (the only one where it sees one),
  // else the CPU.
  TORCH_ARG(std::optional<torch::Device>, device) = std::nullopt;
  // How long joining the job, and any collective, may wait.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  // The store's address and port where the launcher leaves them open
  // (mpirun or mpiexec without MASTER_ADDR and MASTER_PORT): by default
  // 127.0.0.1 on one host, and a port that follows the MPI job or 29500.
  TORCH_ARG(std::string, master_addr) = "";
  TORCH_ARG(int, master_port) = 0;
  // What every rank must agree on (a model's size, a learning rate):
  // compared with rank 0's while joining; a difference is one error naming
  // the setting and both values.
  TORCH_ARG(Settings, settings) = {};
};

class ProcessGroup {
 public:
  int rank() const;
  int world_size() const;
  // This rank's place among the ranks of its machine.
  int local_rank() const;
  int local_world_size() const;
  const torch::Device& device() const;
  const std::string& backend() const;  // "gloo" or "nccl"
  std::chrono::milliseconds timeout() const;
  // Which start of the job's workers this is: 0, then one more per restart
  // (our launcher's --max-restarts, torchrun's, a requeued Slurm job's),
  // the same on every rank.
  int restart() const;
  // Which launcher started this process: "mnist_ddp", "torchrun", "slurm",
  // "mpirun", "mpiexec", "kubeflow", or "" for none (a world of 1).
  const std::string& launcher() const;

  // Blocking collectives on the bulk stream, for the program's own use.
  // Every rank must call them in the same order. Tensors on device().
  void allreduce_sum(torch::Tensor& tensor) const;
  void broadcast(torch::Tensor& tensor, int root = 0) const;
  void barrier() const;

  // The two ordered streams (collectives.hpp): `stream` carries the bulk
  // (gradient buckets, checkpoints, replica checks); `quick` the small
  // collectives that computation waits on (SyncBatchNorm's statistics), so
  // that none of them queues behind a bucket crossing a slow link. Under
  // NCCL, and for a world of 1, they are one.
  const std::shared_ptr<CollectiveStream>& stream() const;
  const std::shared_ptr<CollectiveStream>& quick() const;
  // A further stream over a group of its own (the second
  // DistributedDataParallel of a program gets one, so that two models'
  // buckets never need matching against each other). Collective: every
  // rank calls it the same number of times, in the same order.
  std::shared_ptr<CollectiveStream> new_stream() const;
  // The stream a DistributedDataParallel's buckets take: the bulk stream
  // for the group's first, a new_stream() for each later one. Collective
  // as new_stream() is.
  std::shared_ptr<CollectiveStream> model_stream() const;

  const StorePtr& store() const;
  // The machine rank `rank` runs on (0 ... nodes - 1), as its launcher
  // placed it: node 0's ranks come first.
  int node_of(int rank) const;

  // The ranks whose heartbeat stopped: after a collective failed, who is
  // gone. Watches the store for a few seconds; rank 0 when the store itself
  // is gone (its host took rank 0 along); nullopt when the store does not
  // answer (its host, or the link to it, hangs).
  std::optional<std::vector<int>> silent_ranks() const;

  struct State;
  explicit ProcessGroup(std::shared_ptr<State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<State> state_;
};

// Joins the job the launcher that started this process describes, or forms
// a world of 1 when none did. The first group a process forms becomes its
// default (default_process_group()). Throws UsageError for an environment
// or options that cannot work, std::runtime_error with a one-line reason
// otherwise: port in use, store unreachable, a node or rank that never
// arrives, two nodes with one node rank, a setting that differs; PeerLost
// when the store's host went away.
ProcessGroup init_process_group(const ProcessGroupOptions& options = {});

// The same for a worker whose launcher's environment is already read (the
// mnist_ddp application resolves it against its own flags first).
ProcessGroup init_process_group(const WorkerEnv& env, const ProcessGroupOptions& options);

// The group the process formed first, while any handle to it lives.
std::optional<ProcessGroup> default_process_group();

// A group over a store whose ranks are settled, for tests that run ranks
// as threads over one HashStore: starts the heartbeat and forms the groups;
// blocks until every rank has joined. `backend` "gloo" takes CPU or CUDA
// tensors, "nccl" CUDA tensors. With `shared_memory` (every rank on this
// host), a Gloo group on the CPU sums through shared memory. Gloo listens
// at `gloo_address`. Never becomes the default group.
ProcessGroup make_process_group(StorePtr store, int rank, int world_size, const std::string& backend,
                                torch::Device device, std::chrono::milliseconds timeout, bool shared_memory = false,
                                const std::string& gloo_address = "127.0.0.1");

}  // namespace mnist_ddp
