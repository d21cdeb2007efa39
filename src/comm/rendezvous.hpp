// The rendezvous: how the ranks of a job meet in its store before they
// form their groups (process_group.hpp). Private to the library.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "base/environment.hpp"
#include "mnist_ddp/base/errors.hpp"
#include "mnist_ddp/comm/process_group.hpp"
#include "comm/secrets.hpp"
#include "comm/store.hpp"

namespace mnist_ddp {

// What a rank says when the store stops answering: its host stopped, and
// whoever stopped it says why.
PeerLost store_lost(const std::exception& e);

// The local address that packets to `host` leave from: Gloo listens there,
// so peers on other machines can reach it. Loopback for a single-node job.
std::string local_address_towards(const std::string& host);

// The store the workers of this start meet in, the store's root, and which
// start of the job it is (see rendezvous.cpp, "Note on torchrun's
// restarts"). The ranks of another launcher compare their secrets there
// (comm/secrets.hpp): a rank that cannot use its MNIST_DDP_SECRET_FILE, or
// whose secret differs from rank 0's, throws UsageError, having said so at
// the root of the store (if it answered within 5 s) for the other ranks'
// refused_secret(); rank 0, where it cannot use its file, says so to the
// others the same way first.
struct JobStore {
  StorePtr store, root;
  int start = 0;
  bool hosted = false;  // this rank hosts it
  SecretKeys secret_keys{0};
};
JobStore open_job_store(const WorkerEnv& env, std::chrono::milliseconds timeout);

// Throws UsageError if a rank of `world_size` (any, while the ranks are
// not yet agreed: 0) has said at `root` that its secret differs or that it
// cannot use its file; the store's `host` first waits (5 s at most) for
// the others to read it.
void refused_secret(const StoreClient& root, const SecretKeys& keys, int world_size, bool host);

// This rank's place among the nodes' workers when the launcher left it
// open: each node's local rank 0 claims its node rank and announces its
// worker count and node count; node 0's ranks come first. A node started
// with another node count is named as soon as it is seen.
struct RankPlan {
  int rank = 0, world_size = 1;
  std::vector<int> node_of_rank;
};
RankPlan agree_on_ranks(const StoreClient& store, const WorkerEnv& env, std::chrono::milliseconds timeout,
                        const std::function<void()>& check);

// Rank 0 checks everyone's settings, everyone checks rank 0's: a
// difference is one error naming the setting and both values.
// Every rank waits until rank 0 has checked them all; `check` runs while
// any waits (refused_secret_file()).
void check_settings(const StoreClient& store, int rank, int world_size, const Settings& settings,
                    std::chrono::milliseconds timeout, const std::function<void()>& check);

// A process that no launcher we know started as a worker: one that a
// Kubeflow pod's environment makes a node of one process; nullopt for a
// world of 1. UsageError for a pod that asks for more.
std::optional<WorkerEnv> pod_worker(const Environment& environment);

}  // namespace mnist_ddp
