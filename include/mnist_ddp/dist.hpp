// The multi-process state of one worker: rendezvous store and process groups.
//
// A Dist of world size 1 behaves like any other, so training code never asks
// whether it is distributed. The c10d TCPStore is hosted by node 0's
// launcher (ours), by torchrun's agent when it says so, else by rank 0
// (Slurm, a torchrun without agent store); the rank's one
// process group is c10d::ProcessGroupGloo (CPU, or CUDA tensors when ranks
// share a GPU) or c10d::ProcessGroupNCCL (CUDA, when LibTorch has it), and
// every collective on it goes through one ordered stream (collectives.hpp).
#pragma once

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "mnist_ddp/collectives.hpp"
#include "mnist_ddp/launcher.hpp"

namespace mnist_ddp {

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
  std::string backend = "gloo";         // "gloo" or "nccl"
  torch::Device device = torch::kCPU;   // where this worker's tensors live
  std::chrono::milliseconds timeout{300'000};
  int restart = 0;  // which start of the job's workers this is (WorkerEnv::restart)
  std::string gloo_address = "127.0.0.1";  // local address Gloo listens on
  StorePtr store;
  // The one way to the other ranks: DDP, SyncBatchNorm, metrics, checks.
  std::shared_ptr<Collectives> comm;

  // The ranks whose heartbeat stopped: after a collective failed, who is
  // gone. Watches the store for a few seconds; rank 0 when the store
  // itself is gone (its host, rank 0 or node 0's launcher, took rank 0 along).
  std::vector<int> silent_ranks() const;

 private:
  friend Dist connect(const WorkerEnv&, const Placement&, double, const Settings&);
  std::shared_ptr<Heartbeat> heartbeat_;  // every rank beats into the store once a second
};

// Builds a Dist over an existing store (tests use a HashStore shared by
// threads). Creates the group; blocks until every rank has joined.
// `backend` "gloo" takes CPU or CUDA tensors, "nccl" CUDA tensors. With
// `shared_memory` (every rank on this host), a Gloo group on the CPU sums
// through shared memory, as connect() does for a job on one host.
Dist make_dist(StorePtr store, int rank, int world_size, const std::string& backend, torch::Device device,
               std::chrono::milliseconds timeout, bool shared_memory = false);

// Hosts the job's TCPStore at addr:port (port 0: a free one; reachable only
// at addr's IPv4 address), or, unless `host`, reaches it within `timeout`.
// Throws std::runtime_error with a one-line reason (port in use, store
// unreachable).
c10::intrusive_ptr<c10d::TCPStore> open_store(const std::string& addr, int port, bool host,
                                              std::chrono::milliseconds timeout);

// A store value as text, and text as a store value.
std::vector<uint8_t> bytes_of(const std::string& s);
std::string text_of(const std::vector<uint8_t>& b);

// Joins the job described by the environment: at its launcher's store, under
// the key prefix of the launcher's start (env.round); at torchrun's agent's
// store, under the prefix of torchrun's start (env.agent_store); or as
// rank 0 hosting the store under Slurm and a torchrun without agent store. When the
// environment leaves ranks open (our launcher's workers), the nodes agree
// on them there: each node's local rank 0 announces its worker count, and
// node 0's ranks come first, then node 1's, and so on. Every rank then
// compares its `settings` with rank 0's. Throws std::runtime_error with a
// one-line reason: port in use, store unreachable, a node or rank that
// never arrives, two nodes with one --node-rank, a setting that differs.
Dist connect(const WorkerEnv& env, const Placement& placement, double timeout_seconds, const Settings& settings);

// What this binary was built against and runs on.
struct Runtime {
  std::string libtorch;  // "2.11.0"
  std::string cuda;      // "13.0"; "" without CUDA
  std::string nccl;      // "2.28.9"; "" without CUDA
  std::string device;    // "cuda:0 (NVIDIA H100 80GB HBM3)", "cpu"
  // The rendezvous store's server loop: "libuv" where LibTorch has it (2.x
  // built with libuv), else "classic" (1.13, and Debian 13's 2.6).
  std::string store;
  // "LibTorch 2.11.0, CUDA 13.0, NCCL 2.28.9, device cuda:0 (NVIDIA H100 ...), libuv store"
  std::string describe() const;
};
Runtime runtime_of(const torch::Device& device);

// Makes `device` current for the calling thread (a no-op on CPU).
void use_device(const torch::Device& device);

}  // namespace mnist_ddp
