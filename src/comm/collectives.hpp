// The ordered collective stream: every collective of one group, issued by
// one thread in one order. Not installed.
//
// Note on order. NCCL and Gloo match collectives across ranks by the order in
// which each rank issues them on a group; NCCL hangs when two ranks issue the
// same collectives in different orders. A rank has several threads that want
// to talk: autograd (SyncBatchNorm's backward, DDP's ready buckets) and the
// main thread (SyncBatchNorm's forward, metrics, checkpoints). So every
// collective on a group is a task on that group's stream, run by its one
// communication thread in the order the tasks were posted. Tasks are posted
// in program order: forward, then backward in autograd's order (a
// deterministic function of the graph), then metrics and checks, which is
// the same on every rank; so the collectives are issued in the same order on
// every rank, by construction. A rank has several streams, each over a group
// of its own (process_group.hpp: the bulk and the quick lane, and one more
// per further DDP model), and each keeps this order for itself: no two
// streams' collectives ever need matching against each other.
//
// Three layers, each wrapping the one below (as c10d's ProcessGroupWrapper
// wraps a backend):
// - a Link moves tensors: the group's collectives, shared memory's (sums,
//   broadcasts, barriers) and the ring, every wait watched (watch.hpp);
// - a Channel checks each collective before it goes over the Link
//   (check.cpp, "Note on the check"), and is what a stream's tasks see;
// - a CollectiveStream orders the tasks and runs them on its thread.
// ddp.join() (parallel/join.hpp) is a layer above them all, built on the
// two things the check offers a rank with nothing to issue: abstain() and
// serve().
#pragma once

#include <torch/torch.h>
#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mnist_ddp/base/errors.hpp"
#include "mnist_ddp/comm/process_group.hpp"
#include "base/port.hpp"
#include "comm/backends.hpp"
#include "comm/issuer.hpp"
#include "comm/watch.hpp"

namespace mnist_ddp {

class SharedMemoryReducer;

// A collective that failed in its backend (Gloo's or c10's exception), in
// our words: as a program sees it, a PeerLost; the mnist_ddp worker names
// who went silent before it reports one.
struct CollectiveFailed : PeerLost {
  using PeerLost::PeerLost;
};

// A refusal every rank raised at the same check (a broadcast from a rank
// that has joined, say): the stream that raised it stays usable.
struct RefusedEverywhere : UsageError {
  using UsageError::UsageError;
};

// A dtype as a user names it: "float32", "bfloat16", "int64".
std::string dtype_name(c10::ScalarType type);

// The operations the check tells apart.
enum class Op : int64_t { allreduce = 1, broadcast, gather, allgather, barrier, reduce_scatter, announce /* nothing sent */ };

// A broadcast from this root is from the group's first rank with data:
// rank 0, or, while ranks have joined (ddp.join()), the highest rank still
// active. Its messages say "from rank 0".
constexpr int kAuthority = -1;

// How a channel checks its collectives (check.cpp, "Note on the check").
enum class Check {
  off,        // not at all: issued as the program asks (ProcessGroupOptions().check_collectives(false))
  before,     // each check completes before its collective is issued (Gloo: a mismatch of sizes aborts it)
  alongside,  // the collective is issued at once, its check verified as it completes (NCCL)
};

// A test's window into a stream (the collective-order test): told of every
// post, every task about to run and every collective issued, so that it
// can record their order and shake the threads' timing. Streams in a run
// have none.
class StreamProbe {
 public:
  virtual ~StreamProbe() = default;
  virtual void posting() {}  // on the posting thread, before its task is queued
  virtual void running() {}  // on the communication thread, before each task
  // On the communication thread, for each collective: "allreduce Double [65]".
  virtual void issued(const std::string& collective) {}
  // On the communication thread, for each check made (before its collective).
  virtual void checked() {}
};

// The ring's pieces (link.cpp, "Note on the link").
constexpr int64_t kLinkPieceBytes = 256 * 1024;
constexpr int kLinkPiecesInFlight = 2;
// A float32 or float64 sum of at most this many elements travels inside
// its own check (check.cpp).
constexpr int64_t kInline = 256;

// The transfers of one lane, unchecked: the group's collectives (through
// shared memory where every rank is on this host and the tensor on the CPU),
// each watched by the group's watchdog. Only its lane's thread uses it.
class Link {
 public:
  // `watch` nullptr: a world of 1, or no watch.
  Link(GroupPtr group, torch::Device device, const Backend& backend, std::unique_ptr<SharedMemoryReducer> shared,
       std::shared_ptr<CollectiveWatch> watch, std::shared_ptr<LaneState> lane);
  ~Link();
  Link(Link&&) = default;

  int rank() const { return group_->getRank(); }
  int world_size() const { return group_->getSize(); }
  const torch::Device& device() const { return device_; }
  // Where tensors of the small blocking collectives travel: the device under
  // NCCL, the CPU under Gloo (whose every collective takes CPU tensors).
  torch::Device staging() const { return backend_.on_device ? device_ : torch::Device(torch::kCPU); }
  bool shares_memory() const { return shared_ != nullptr; }
  const Backend& backend() const { return backend_; }
  const GroupPtr& group() const { return group_; }
  const std::shared_ptr<LaneState>& lane() const { return lane_; }
  const std::shared_ptr<CollectiveWatch>& watch() const { return watch_; }

  // Sums `tensor` over ranks in place; the future completes with it. Runs
  // asynchronously through the group (several may be in flight, completing
  // in issue order), synchronously through shared memory or the ring.
  FuturePtr allreduce_sum(torch::Tensor tensor);
  void broadcast(torch::Tensor& tensor, int root);
  std::vector<torch::Tensor> gather_to_rank0(const torch::Tensor& tensor);
  torch::Tensor allgather(const torch::Tensor& tensor);
  // Sums `input` (world_size chunks of `output`'s size), this rank's chunk into `output`; blocking.
  void reduce_scatter_sum(const torch::Tensor& output, const torch::Tensor& input);
  // Sends `out` to rank `to` while receiving `in` (as many elements, both contiguous)
  // from `from`, in pieces of at most `piece` elements, `depth` in flight each way; blocking.
  void exchange(const torch::Tensor& out, int to, torch::Tensor& in, int from, int64_t piece, int depth);
  void barrier();
  // A check's sum (float64, fixed size) over the ranks, blocking: through
  // shared memory, else `over` (the checks' own group).
  void sum_check(torch::Tensor& sums, const GroupPtr& over);
  // The same, issued and returned at once (Check::alongside).
  FuturePtr sum_check_async(torch::Tensor& sums, const GroupPtr& over);
  // `error`, from a transfer of this lane's, in our words: another lane's
  // mismatch, a rank that ended first (uneven inputs), or `error`.
  std::exception_ptr explained(std::exception_ptr error) const;

  std::shared_ptr<StreamProbe> probe;  // see StreamProbe; set by CollectiveStream::watch
  // Tells the probe of a collective issued ("allreduce Float [65]").
  void issue(const char* kind, const torch::Tensor& tensor);

 private:
  // Waits for `work`, a collective of this lane's, with the lane marked as
  // waiting; the watchdog may end the wait with its verdict. `whole`: a
  // send or a receive, which Gloo's futures do not cover.
  void finish(const port::WorkPtr& work, bool whole = false);
  FuturePtr watched(const port::WorkPtr& work, bool checking);
  torch::Tensor movable(const torch::Tensor& tensor) const;
  // Whether `tensor`'s collectives go through shared memory; `collective` run
  // there, watched (in its check where `checking`): the verdict ends a stall.
  bool through_shared_memory(const torch::Tensor& tensor) const;
  void in_shared_memory(bool checking, const std::function<void(const std::function<void()>&)>& collective);
  // Reduce-scatter then allgather round the ring rank -> rank + 1, adding in
  // float32; blocking.
  void ring_allreduce_sum(torch::Tensor& tensor);

  GroupPtr group_;
  torch::Device device_;
  const Backend& backend_;
  std::unique_ptr<SharedMemoryReducer> shared_;
  std::shared_ptr<CollectiveWatch> watch_;
  std::shared_ptr<LaneState> lane_;
  int tag_ = 0;  // point-to-point tags, the same sequence on every rank
};

// The process group as the communication thread sees it: every collective
// checked against every rank's, then issued over the Link. Only tasks of a
// CollectiveStream (below) touch a Channel, so its calls are never concurrent.
class Channel {
 public:
  // `check_group`: the checks' own group where there is no shared memory
  // (so that a check never waits behind a bucket still on the wire).
  Channel(Link link, Check check, GroupPtr check_group);
  ~Channel();
  Channel(Channel&&) = default;

  int rank() const { return link_.rank(); }
  int world_size() const { return link_.world_size(); }
  const torch::Device& device() const { return link_.device(); }
  torch::Device staging() const { return link_.staging(); }
  bool shares_memory() const { return link_.shares_memory(); }
  Link& link() { return link_; }
  // How its lines name the ranks (the watch's; plain numbers without one).
  const RankNames& names() const;

  // Sums `tensor` over ranks in place; the future completes with it. A
  // float sum of up to kInline elements on the CPU travels in its check.
  FuturePtr allreduce_sum(torch::Tensor tensor);
  // Blocking. `root` may be kAuthority. A broadcast from a rank that has
  // joined (ddp.join()) is a RefusedEverywhere on every rank.
  void broadcast(torch::Tensor& tensor, int root);
  // Every rank's `tensor` (same shape and dtype) on rank 0, in rank order, on
  // the CPU; an empty list elsewhere.
  std::vector<torch::Tensor> gather_to_rank0(const torch::Tensor& tensor);
  // Every rank's `tensor`, stacked in rank order: [world_size, tensor's
  // shape...], on tensor's device. Blocking.
  torch::Tensor allgather(const torch::Tensor& tensor);
  void reduce_scatter_sum(const torch::Tensor& output, const torch::Tensor& input);  // Link's
  void barrier();
  // Sends and receives round the ring (Link::exchange), unchecked: only
  // inside a collective that was checked.
  void exchange(const torch::Tensor& out, int to, torch::Tensor& in, int from, int64_t piece, int depth) {
    link_.exchange(out, to, in, from, piece, depth);
  }

  // Who issues the collectives that follow: the running task's issuer, for
  // the check and its messages.
  void set_issuer(Issuer issuer);
  const Issuer& issuer() const { return issuer_; }
  // Marks the next collective (only) with `tag`, a number the check carries
  // so that a rank that abstains learns it (ddp.join()'s vote).
  void tag_next(int tag) { tag_ = tag; }
  // Compares every rank's `items` (name, value) with rank 0's, in two
  // allgathers; returns, the same on every rank, the line naming the first
  // difference ("<subject>: rank 1's fc1.weight is [512, 784] float32, rank
  // 0's is [16, 784] float32: <advice>"), or "" where all agree. The caller
  // throws it as a UsageError, outside the task where it can: every rank
  // stops at the same point, and the stream stays usable. A rank that
  // abstains is not compared.
  std::string disagreement(const std::vector<std::pair<std::string, std::string>>& items, const std::string& subject,
                           const std::string& advice);

  // What the ranks that issue the next collective issue, as a rank that
  // abstains learns it from the check.
  struct Issued {
    Op op = Op::barrier;
    int64_t dtype = -1, numel = 0;  // dtype -1: no tensor
    int root = 0, tag = 0;          // root: kAuthority resolved; tag: see tag_next()
    bool inlined = false;           // the sum travelled in the check (and is `sum`, as every rank got it)
    torch::Tensor sum;
    int issuers = 0;  // how many ranks issued it
  };
  // Takes part in the next check of this lane without a collective of its
  // own (a rank whose data ran out: ddp.join()), described to the others
  // as `as`; returns what the others issue, or nullopt where every rank
  // abstained at this check.
  std::optional<Issued> abstain(const Issuer& as);
  // Issues what `issued` describes, with zeros, unchecked (its check was
  // the abstain()); returns the result (a sum or a broadcast's tensor).
  torch::Tensor serve(const Issued& issued);
  // Ranks that issued the last collective checked on this lane: the world
  // size unless some abstained.
  int active_ranks() const { return active_; }
  // Verifies every check still pending (Check::alongside); throws what a
  // failed one found. A no-op otherwise.
  void settle();

  // A run of collectives whose every size follows from the first's and
  // from what the ranks have already agreed (a built-in hook over one
  // bucket: its options compared at the first backward, the bucket's
  // layout when the DDP was built). While one lasts, the first collective
  // is checked and the rest, where the check goes before the transfer and
  // every rank issues, go out unchecked: PowerSGD's dependent collectives
  // pay one check's round trip, not one each. A run may go on in the next
  // task of the lane (`id`, `continues`: the next bucket of the same
  // backward, whose sizes the layout fixes too), so that a backward's
  // buckets pay one check between them; any other task between ends it.
  class DeterminedRun {
   public:
    explicit DeterminedRun(Channel& channel, uint64_t id = 0, bool continues = false);
    ~DeterminedRun();
    DeterminedRun(const DeterminedRun&) = delete;
    DeterminedRun& operator=(const DeterminedRun&) = delete;

   private:
    Channel& channel_;
    uint64_t id_;
  };
  // A DeterminedRun's check made ahead of its collectives, which the lane's
  // next task issues, going on from it (a backward's buckets, announced as
  // it begins: the round trip overlaps the backward). Only where the checks have a group of their
  // own (Gloo, Check::before) and every rank issues. False: this channel never announces.
  bool announce(const torch::Tensor& first);
  // The stream's thread starts a task (for DeterminedRun's continuation).
  void starting_task() { ++tasks_; }

 private:
  // What a rank says of the collective it is about to issue.
  struct Described {
    Op op = Op::barrier;
    int64_t dtype = -1;  // -1: no tensor
    int64_t numel = 0;
    int root = 0;
    int tag = 0;
    bool inlined = false;
    std::string what;        // "DDP bucket 0's backward (allreduce, 1181066 float32)"
    int64_t pieces[3] = {};  // its fingerprint, 16 bits a piece
  };
  // A check of Check::alongside in flight, and what it will be held to.
  struct Pending {
    uint64_t position = 0;
    Described described;
    torch::Tensor sums;
    FuturePtr done;
  };
  // The check before each collective. `inlined`, where given, is a float
  // sum that travels inside it. Returns the root (kAuthority resolved) and
  // whether the check carried the sum.
  struct Outcome {
    int root = 0;
    bool served = false;
  };
  Outcome check(Op op, const torch::Tensor& tensor, int root, torch::Tensor* inlined = nullptr);
  Described describe(Op op, const torch::Tensor& tensor, int root, bool inlined) const;
  void check_alongside(const Described& d, uint64_t position, torch::Tensor sums);
  // One check's sum, blocking, with the lane marked as in its check.
  void exchange_check(torch::Tensor& sums);
  uint64_t enter_check(const std::string& what);
  void pass_check();
  // What the summed check `sums` says; throws CollectiveMismatch where the
  // issuing ranks differ. `mine` is nullptr for a rank that abstains.
  Outcome verify(const torch::Tensor& sums, const Described* mine, uint64_t position);
  [[noreturn]] void mismatch(uint64_t position, const std::string& mine);
  [[noreturn]] void refuse_broadcast(const double* sums, const Described* mine, int root);
  // A check of Check::alongside that has completed, verified; false while
  // it has not completed (`block`: waits for it).
  bool settle_oldest(bool block);
  torch::Tensor check_tensor(const Described* mine) const;
  // Whether this collective goes unchecked: it follows a checked one in a
  // DeterminedRun, the check goes first, and every rank issues.
  bool follows_checked() const { return run_ == Run::following && check_ == Check::before && active_ == world_size(); }

  Link link_;
  const Check check_;
  GroupPtr check_group_;
  Issuer issuer_{"a task on the stream"};
  int tag_ = 0;
  const int64_t inline_;  // elements of a sum the check can carry: kInline, or 0 where it never does
  int active_;            // see active_ranks()
  enum class Run { none, first, following } run_ = Run::none;  // see DeterminedRun
  uint64_t tasks_ = 0;       // tasks this lane has started
  uint64_t run_ended_ = 0;   // the task in which the last run ended, checked
  uint64_t run_id_ = 0;      // and its id
  std::deque<std::unique_ptr<Pending>> pending_;  // Check::alongside: issued, not yet verified
};

class CollectiveStream {
 public:
  using Task = std::function<void(Channel&)>;
  using Ticket = uint64_t;

  // Starts the communication thread, which makes the channel's device
  // current for itself.
  explicit CollectiveStream(Channel channel);
  // Runs what is still queued, stops the thread, and shuts the group down
  // (Backend::shut_down) unless a collective failed. Safe on any thread,
  // its own included (a task that held the last handle to it).
  ~CollectiveStream();
  CollectiveStream(const CollectiveStream&) = delete;
  CollectiveStream& operator=(const CollectiveStream&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const torch::Device& device() const { return device_; }
  // Whether CPU sums go through shared memory (see Link).
  bool shares_memory() const { return shares_memory_; }

  // Queues `task` behind every task posted before it; never blocks on the
  // network. Any thread may post. `issuer` says who issues its collectives,
  // for the check and its messages. `skipped` is told why where the task
  // will not run (an earlier failure, abandon()), outside the stream's
  // lock. A task owns what it touches: it may run after its poster is gone.
  // `program`: a Work of the program's, whose failure, where no wait ever
  // throws it, is named when the group ends (unseen_failure()).
  using Skipped = std::function<void(std::exception_ptr)>;
  Ticket post(Task task, Issuer issuer = Issuer("a task on the stream"), Skipped skipped = nullptr,
              bool program = false);
  // Blocks until task `ticket` has run. Rethrows what it threw, as an
  // mnist_ddp::Error (a backend's own exception becomes a PeerLost whose
  // line says what the lane was doing, the backend's text after it). Once a
  // task has failed, later tasks are not run (no further collectives are
  // issued) and waiting on them rethrows that first failure, unless it was
  // a RefusedEverywhere (every rank refused it alike: only its own wait
  // throws it). So does a wait while another lane of this rank has found
  // its collectives mismatched (its collectives may never complete: NCCL's,
  // checked alongside); no task of this lane that has not started runs
  // after that. A wait on the stream's own thread (a Work's callback, a
  // hook, calling a collective) is a UsageError at once: it would wait for
  // itself.
  void wait(Ticket ticket);
  // Waits at most `timeout` for task `ticket` to run (or be skipped);
  // whether it has. Throws nothing (wait() says how it ended).
  bool wait_for(Ticket ticket, std::chrono::milliseconds timeout);
  // post + wait.
  void run(const Task& task, Issuer issuer = Issuer("a task on the stream"));
  // post(), with a future that completes with what `task` returns, or with
  // its error in our words (a task not run after an earlier failure: that
  // failure).
  std::pair<Ticket, FuturePtr> post_for(std::function<c10::IValue(Channel&)> task, Issuer issuer);
  // Whether task `ticket` has run (or been skipped).
  bool finished(Ticket ticket);
  // Gives the stream up (ProcessGroup::shutdown): every wait on a task
  // posted before throws `why`, on one posted after `later` (`why` where
  // null); no further task runs; a task still waiting on a peer is left to
  // the process's end.
  void abandon(std::exception_ptr why, std::exception_ptr later = nullptr);
  // Waits until every task posted so far has run or been skipped, throwing
  // nothing (a no-op on the stream's own thread).
  void drain();
  // Aborts the backend's group (Backend::abort): NCCL's communicators.
  void abort_backend();
  // The first failure of a Work of the program's that no wait ever threw,
  // or null.
  std::exception_ptr unseen_failure();

  // Blocking conveniences, one task each.
  void allreduce_sum(torch::Tensor& tensor, Issuer issuer = Issuer("a task on the stream"));
  void broadcast(torch::Tensor& tensor, int root = 0, Issuer issuer = Issuer("a task on the stream"));
  std::vector<torch::Tensor> gather_to_rank0(const torch::Tensor& tensor, Issuer issuer = Issuer("a task on the stream"));
  torch::Tensor allgather(const torch::Tensor& tensor, Issuer issuer = Issuer("a task on the stream"));
  // Rank 0's `bytes` on every rank.
  void broadcast_bytes(std::vector<char>& bytes, Issuer issuer = Issuer("a task on the stream"));
  // Channel::disagreement, as one task.
  std::string disagreement(std::vector<std::pair<std::string, std::string>> items, std::string subject,
                           std::string advice, Issuer issuer);
  void barrier(Issuer issuer = Issuer("a task on the stream"));

  // Hands every later post, task and collective to `probe` (nullptr: none).
  // In order with the tasks: a task posted before it runs unwatched.
  void watch(std::shared_ptr<StreamProbe> probe);

  // `error`, from a transfer its caller waited for itself (a bucket's future), as the lane's wait says it.
  std::exception_ptr explained(std::exception_ptr error);
  // The group's watchdog (nullptr for a world of 1), for a waiter that
  // waits on this lane's futures itself.
  CollectiveWatch* watchdog() const { return watch_.get(); }
  const std::shared_ptr<LaneState>& lane() const { return lane_; }

 private:
  struct Core;  // what the thread touches: it outlives the handle where the thread must
  static void loop(const std::shared_ptr<Core>& core);

  const int rank_, world_size_;
  const torch::Device device_;
  const bool shares_memory_;
  std::shared_ptr<CollectiveWatch> watch_;
  std::shared_ptr<LaneState> lane_;
  std::shared_ptr<Core> core_;
  std::thread thread_;
};

}  // namespace mnist_ddp
