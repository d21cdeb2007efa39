// A worker's place in the job: who it is, where its tensors live, and its
// one way to the other ranks.
//
// A Job of world size 1 behaves like any other, so training code never asks
// whether it is distributed. The rank joins the job's store (store.hpp),
// agrees on its rank, checks its settings against rank 0's, and forms its
// process group: c10d::ProcessGroupGloo (CPU, or CUDA tensors when ranks
// share a GPU) or c10d::ProcessGroupNCCL (CUDA, when LibTorch has it). Every
// collective on it goes through the job's ordered stream (collectives.hpp).
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mnist_ddp/base/environment.hpp"
#include "mnist_ddp/comm/collectives.hpp"
#include "mnist_ddp/comm/store.hpp"

namespace mnist_ddp {

class Heartbeat;

struct Job {
  int rank = 0;
  int world_size = 1;
  std::string backend = "gloo";         // "gloo" or "nccl"
  torch::Device device = torch::kCPU;   // where this worker's tensors live
  std::chrono::milliseconds timeout{300'000};
  // Which start of the job's workers this is: 0, then one more per restart,
  // the same on every rank (rendezvous.cpp, "Note on torchrun's restarts").
  int restart = 0;
  std::string gloo_address = "127.0.0.1";  // local address Gloo listens on
  StorePtr store;
  // The ways to the other ranks, two ordered streams (collectives.hpp):
  // `stream` carries the bulk (DDP's gradient buckets, checkpoints, replica
  // checks); `quick` the small collectives that computation waits on
  // (SyncBatchNorm's statistics, the stop vote, metrics), so that none of
  // them queues behind a bucket crossing a slow link. Each is ordered in
  // itself, which is all that matching collectives across ranks needs: the
  // two are separate process groups. Under NCCL (one GPU each, fast links)
  // `quick` is `stream`.
  std::shared_ptr<CollectiveStream> stream;
  std::shared_ptr<CollectiveStream> quick;

  // The ranks whose heartbeat stopped: after a collective failed, who is
  // gone. Watches the store for a few seconds; rank 0 when the store
  // itself is gone (its host, rank 0 or node 0's launcher, took rank 0 along).
  std::vector<int> silent_ranks() const;

 private:
  friend Job make_job(StorePtr, int, int, const std::string&, torch::Device, std::chrono::milliseconds, bool,
                      const std::string&);
  std::shared_ptr<Heartbeat> heartbeat_;  // every rank beats into the store once a second
};

// Builds a Job over a store whose ranks are settled (join_job() does that;
// tests use a HashStore shared by threads): starts its heartbeat and
// creates the group; blocks until every rank has joined. `backend` "gloo"
// takes CPU or CUDA tensors, "nccl" CUDA tensors. With `shared_memory`
// (every rank on this host), a Gloo group on the CPU sums through shared
// memory. Gloo listens at `gloo_address`.
Job make_job(StorePtr store, int rank, int world_size, const std::string& backend, torch::Device device,
             std::chrono::milliseconds timeout, bool shared_memory = false,
             const std::string& gloo_address = "127.0.0.1");

// Joins the job the environment describes, with `backend` on `device`: at
// its launcher's store, under the key prefix of the launcher's start
// (env.round); at torchrun's agent's store, under the prefix of torchrun's
// start (env.agent_store); or as rank 0 hosting the store under Slurm and a
// torchrun without agent store. When the environment leaves ranks open (our
// launcher's workers), the nodes agree on them there: each node's local
// rank 0 announces its worker count, and node 0's ranks come first, then
// node 1's, and so on. Every rank then compares its `settings` with rank
// 0's. Throws std::runtime_error with a one-line reason: port in use, store
// unreachable, a node or rank that never arrives, two nodes with one
// --node-rank, a setting that differs; PeerLost when the store's host went away.
Job join_job(const WorkerEnv& env, const std::string& backend, torch::Device device,
             std::chrono::milliseconds timeout, const std::vector<std::pair<std::string, std::string>>& settings);

}  // namespace mnist_ddp
