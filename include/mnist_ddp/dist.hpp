// The multi-process state of one worker: rendezvous store and process groups.
//
// A Dist of world size 1 behaves like any other, so training code never asks
// whether it is distributed. Rank 0 hosts a c10d TCPStore; groups are
// c10d::ProcessGroupGloo (CPU) or c10d::ProcessGroupNCCL (CUDA, when LibTorch
// has it). LibTorch 1.13 calls the group type ProcessGroup, 2.x calls the
// per-backend type Backend; `Group` names whichever this LibTorch has.
#pragma once

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/version.h>

#include <chrono>
#include <string>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#include "mnist_ddp/launcher.hpp"

namespace mnist_ddp {

#if TORCH_VERSION_MAJOR >= 2
using Group = c10d::Backend;
#else
using Group = c10d::ProcessGroup;
#endif
using GroupPtr = c10::intrusive_ptr<Group>;
using StorePtr = c10::intrusive_ptr<c10d::Store>;
using Settings = std::vector<std::pair<std::string, std::string>>;

class Heartbeat;

// A failure that only echoes another process's: the store or a peer went
// away. The launcher prefers a cause reported by another worker.
struct PeerLost : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Dist {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int node_rank = 0;
  std::string backend = "gloo";         // "gloo" or "nccl"
  torch::Device device = torch::kCPU;   // where this worker's tensors live
  std::chrono::milliseconds timeout{300'000};
  std::string gloo_address = "127.0.0.1";  // local address Gloo listens on
  StorePtr store;
  // The main thread's group: SyncBatchNorm, metrics, evaluation. DDP makes
  // its own (see ddp.hpp) so that the two never interleave collectives.
  GroupPtr group;

  // A further group over the same ranks, with its own connections and its
  // own sequence of collectives. Every rank must create its groups in the
  // same order. Each group gets a store prefix of its own (name and
  // sequence number): a reused prefix would find a finished group's
  // addresses.
  GroupPtr new_group(const std::string& name) const;

  // The ranks whose heartbeat stopped: after a collective failed, who is
  // gone. Watches the store for a few seconds; rank 0 when the store
  // itself is gone (rank 0 hosts it).
  std::vector<int> silent_ranks() const;

 private:
  friend Dist connect(const WorkerEnv&, const Placement&, double, const Settings&);
  mutable int groups_created_ = 0;
  std::shared_ptr<Heartbeat> heartbeat_;  // every rank beats into the store once a second
};

// Builds a Dist over an existing store (tests use a HashStore shared by
// threads). Creates the main group; blocks until every rank has joined.
Dist make_dist(StorePtr store, int rank, int world_size, const std::string& backend, torch::Device device,
               std::chrono::milliseconds timeout);

// Joins the job described by the environment. Rank 0 hosts the TCPStore
// (reporting its port when asked to); the others connect to it. When the
// environment leaves ranks open (our launcher's workers), the nodes agree
// on them there: each node's local rank 0 announces its worker count, and
// node 0's ranks come first, then node 1's, and so on. Every rank then
// compares its `settings` with rank 0's. Throws std::runtime_error with a
// one-line reason: port in use, store unreachable, a node or rank that
// never arrives, two nodes with one --node-rank, a setting that differs.
Dist connect(const WorkerEnv& env, const Placement& placement, double timeout_seconds, const Settings& settings);

// Makes `device` current for the calling thread (a no-op on CPU).
void use_device(const torch::Device& device);

// Blocking collectives; a timeout or a lost peer throws.
void allreduce_sum(Group& group, at::Tensor& tensor);
void broadcast(Group& group, at::Tensor& tensor, int root = 0);
// Every rank's `tensor` (same shape and dtype everywhere) on rank 0, in rank
// order; an empty list elsewhere. `device` is where the group's tensors live.
std::vector<at::Tensor> gather_to_rank0(Group& group, const at::Tensor& tensor, const torch::Device& device);
// Rank 0's `bytes` on every rank.
void broadcast_bytes(Group& group, std::vector<char>& bytes, const torch::Device& device);

}  // namespace mnist_ddp
