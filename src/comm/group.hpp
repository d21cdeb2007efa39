// The process group as the library and its application see it: its
// streams, its store, where each rank runs, who went silent. Not installed;
// a program sees process_group.hpp only.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mnist_ddp/comm/process_group.hpp"
#include "base/environment.hpp"
#include "comm/collectives.hpp"
#include "comm/store.hpp"

namespace mnist_ddp {


struct ProcessGroup::State {
  // Tells the other ranks this one is done (CollectiveWatch::ended), then
  // lets go of the streams.
  ~State();
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string backend = "gloo";
  c10::Device device = c10::kCPU;
  std::chrono::milliseconds timeout{300'000};
  int restart = 0;
  std::string launcher;
  std::string gloo_address = "127.0.0.1";
  bool shared_memory = false;
  Check check = Check::before;  // how its streams check their collectives
  StorePtr store;
  std::shared_ptr<CollectiveWatch> watch;  // the heartbeat, and what each lane is doing
  std::shared_ptr<CollectiveStream> stream, quick;
  std::vector<std::weak_ptr<CollectiveStream>> streams;  // every stream made, for ddp.join()
  int streams_made = 0;           // by new_stream(), for their store prefixes
  std::shared_ptr<std::atomic<int>> models = std::make_shared<std::atomic<int>>(0);  // DistributedDataParallels built over it
  std::atomic<bool> shut_down{false};  // ProcessGroup::shutdown()
  int groups_made = 0;     // by new_group(), for their store prefixes
  // A view (view_of()): the group it shows through streams of its own;
  // what a view asks of the group as a whole (its streams, its count of
  // models) is its base's.
  std::shared_ptr<State> base;
  std::vector<int> node_of_rank;  // where our launcher's nodes placed each rank; empty: uniform
};

// What the library's own code may ask of a group beyond its public calls.
struct GroupAccess {
  using State = ProcessGroup::State;
  static ProcessGroup make(std::shared_ptr<State> state) { return ProcessGroup(std::move(state)); }
  static State& state(const ProcessGroup& group) { return *group.state_; }
  static std::shared_ptr<State> share(const ProcessGroup& group) { return group.state_; }
  static Work work(std::shared_ptr<Work::State> state) { return Work(std::move(state)); }
  static Work::State& state(const Work& work) { return *work.state_; }
};
using GroupState = GroupAccess::State;

// The two ordered streams (collectives.hpp): the bulk one carries gradient
// buckets and what a checkpoint gathers; the quick one everything that
// computation waits on (SyncBatchNorm's statistics, DDP's buffers and
// start, the replica check, the program's own collectives), so that none
// of them queues behind a bucket crossing a slow link, and so that the
// mistakes users make (a forward on one rank, uneven inputs) meet their
// peers' collectives on one stream, where the check sees them. Under NCCL,
// and for a world of 1, they are one.
const std::shared_ptr<CollectiveStream>& bulk_stream(const ProcessGroup& group);
const std::shared_ptr<CollectiveStream>& quick_stream(const ProcessGroup& group);
// A further stream over a group of its own. Collective: every rank calls
// it the same number of times, in the same order.
std::shared_ptr<CollectiveStream> new_stream(const ProcessGroup& group);
// The group as its next DistributedDataParallel uses it, and that DDP's
// index (0, 1, ...): the group itself for the first; for each later one a
// view of it whose every collective (buckets, SyncBatchNorm's, the
// program's own through it) takes a new_stream() of its own, so that two
// models trained on two threads never need their collectives matched
// against each other. Collective: every rank builds its DDPs in one order.
// `models` counts the group's DDPs as they are built.
struct ModelPlace {
  ProcessGroup group;
  int model = 0;
  std::shared_ptr<const std::atomic<int>> models;
};
ModelPlace model_group(const ProcessGroup& group);
// Every stream of the group still alive, the bulk one first.
std::vector<std::shared_ptr<CollectiveStream>> streams_of(const ProcessGroup& group);

// The machine rank `rank` runs on (0 ... nodes - 1), as its launcher placed
// it: node 0's ranks come first.
int node_of(const ProcessGroup& group, int rank);
// The ranks whose heartbeat stopped: after a collective failed, who is
// gone. Watches the store for a few seconds; rank 0 when the store itself
// is gone (its host took rank 0 along); nullopt when the store does not
// answer (its host, or the link to it, hangs).
std::optional<std::vector<int>> silent_ranks(const ProcessGroup& group);

// The group a program's own collectives and a DDP's streams take their
// store prefixes and counts from: the group itself, or a view's base.
GroupState& base_of(const ProcessGroup& group);

// Forms a group over `store` (whose keys it owns) from its settled ranks:
// its heartbeat, its streams; `check`: nullopt for the backend's default;
// `names`: how its lines name its ranks (a new_group()'s, by the job's).
std::shared_ptr<GroupState> form(StorePtr store, int rank, int world_size, const Backend& backend,
                                 torch::Device device, std::chrono::milliseconds timeout, bool shared_memory,
                                 const std::string& gloo_address, std::optional<Check> check, RankNames names = {});

// Joins the job for a worker whose launcher's environment is already read
// (the mnist_ddp application resolves it against its own flags first).
ProcessGroup init_process_group(const WorkerEnv& env, const ProcessGroupOptions& options);

// A group over a store whose ranks are settled, for tests that run ranks
// as threads over one HashStore: starts the heartbeat and forms the groups;
// blocks until every rank has joined. `backend` "gloo" takes CPU or CUDA
// tensors, "nccl" CUDA tensors. With `shared_memory` (every rank on this
// host), a Gloo group on the CPU sums through shared memory. Gloo listens
// at `gloo_address`. Never becomes the default group.
// `check`: how its streams check collectives; nullopt: as the backend's
// default (Check::alongside under NCCL, Check::before otherwise).
ProcessGroup make_process_group(StorePtr store, int rank, int world_size, const std::string& backend,
                                c10::Device device, std::chrono::milliseconds timeout, bool shared_memory = false,
                                const std::string& gloo_address = "127.0.0.1", std::optional<Check> check = std::nullopt);

}  // namespace mnist_ddp
