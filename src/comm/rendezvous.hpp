// The rendezvous: how the ranks of a job meet in its store before they
// form their groups (process_group.hpp). Private to the library.
#pragma once

#include <chrono>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "base/environment.hpp"
#include "mnist_ddp/base/errors.hpp"
#include "mnist_ddp/comm/process_group.hpp"
#include "comm/store.hpp"

namespace mnist_ddp {

// What a rank says when the store stops answering: its host stopped, and
// whoever stopped it says why.
PeerLost store_lost(const std::exception& e);

// The local address that packets to `host` leave from: Gloo listens there,
// so peers on other machines can reach it. Loopback for a single-node job.
std::string local_address_towards(const std::string& host);

// The store the workers of this start meet in, and which start of the job
// it is (see rendezvous.cpp, "Note on torchrun's restarts").
std::pair<StorePtr, int> open_job_store(const WorkerEnv& env, std::chrono::milliseconds timeout);

// This rank's place among the nodes' workers when the launcher left it
// open: each node's local rank 0 claims its node rank and announces its
// worker count and node count; node 0's ranks come first. A node started
// with another node count is named as soon as it is seen.
struct RankPlan {
  int rank = 0, world_size = 1;
  std::vector<int> node_of_rank;
};
RankPlan agree_on_ranks(const StoreClient& store, const WorkerEnv& env, std::chrono::milliseconds timeout);

// Rank 0 checks everyone's settings, everyone checks rank 0's: a
// difference is one error naming the setting and both values.
void check_settings(const StoreClient& store, int rank, int world_size, const Settings& settings,
                    std::chrono::milliseconds timeout);

}  // namespace mnist_ddp
