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
// Note on the check. A program can still issue different collectives on
// different ranks (a model or hook that differs, a SyncBatchNorm forward on
// one rank, a rank whose data ran out). So each collective is preceded by a
// check: every rank says what it is about to issue (who issues it, "DDP
// bucket 0's backward", the operation, dtype, element count and root) as a
// fingerprint in a fixed-size sum over the ranks, the same size whatever the
// collective, so a mismatch can never put anything of a size another rank
// does not expect on the wire (Gloo aborts the process then). The sums of
// the fingerprints and of their squares tell every rank at once whether
// all agree; a verdict rests on nothing else: two ranks' descriptions of
// the same position of the same stream. Ranks that differ then leave their
// own words in the store and throw the same CollectiveMismatch.
//
// What it costs (docs/design.md, "The check"): a small float sum (up to
// kInline elements: SyncBatchNorm's statistics, votes, metrics) travels in
// its own check, so it costs nothing more; a larger collective's check goes
// over a group of its own (through shared memory on one host), so it never
// queues behind a bucket still on the wire. Under NCCL the check travels
// on a Gloo group beside the collective, which is issued at once, and is
// verified when it completes: no host synchronisation per collective.
//
// The same check carries ddp.join(): a rank whose data ran out says so in
// it, learns from it what the active ranks issue, and serves that with
// zeros until every rank has joined.
#pragma once

#include <torch/torch.h>
#include <ATen/core/ivalue.h>
#include <torch/version.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mnist_ddp/base/errors.hpp"
#include "mnist_ddp/comm/process_group.hpp"
#include "base/port.hpp"
#include "comm/backends.hpp"
#include "comm/watch.hpp"

namespace mnist_ddp {

class SharedMemoryReducer;

// A collective that failed in its backend (Gloo's or c10's exception), in
// our words: as a program sees it, a PeerLost; the mnist_ddp worker names
// who went silent before it reports one.
struct CollectiveFailed : PeerLost {
  using PeerLost::PeerLost;
};

// A dtype as a user names it: "float32", "bfloat16", "int64".
std::string dtype_name(c10::ScalarType type);

// The operations the check tells apart.
enum class Op : int64_t { allreduce = 1, broadcast, gather, allgather, barrier };

// A broadcast from this root is from the group's first rank with data:
// rank 0, or, while ranks have joined (ddp.join()), the highest rank still
// active. Its messages say "from rank 0".
constexpr int kAuthority = -1;

// How a channel checks its collectives (collectives.hpp, "the check").
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

// The process group as the communication thread sees it. Only tasks of a
// CollectiveStream (below) touch a Channel, so its calls are never concurrent.
//
// With a SharedMemoryReducer (every rank on this host, CPU tensors), sums
// of CPU tensors and the checks go through it and everything else through
// the group.
//
// Note on the link. Without shared memory, a 16-bit float tensor on the CPU
// (float16 of 64 Ki elements or more; bfloat16 always, which Gloo may not
// add) goes round a ring of point-to-point transfers that adds in float32:
// Gloo's own allreduce adds float16 one element at a time, which made the
// fp16 hook slower than sending float32. The ring sends pieces of
// kLinkPieceBytes, kLinkPiecesInFlight at a time, not a whole chunk per
// exchange: over a shaped link that took fp16 from 326 to 214 ms/step at
// 100 Mbit/s and from 54 to 46 at 1 Gbit/s (docs/performance.md; the link's
// queue peaked at about 0.4 MB either way, so why was not pinned down).
// Everything else, float32 included, goes to Gloo's allreduce,
// asynchronously: the same pieced ring for float32 was 5% faster at 1
// Gbit/s but 22% slower unshaped (44 against 36 ms/step), its pieces
// costing the one core a node has there more than they saved.
constexpr int64_t kLinkPieceBytes = 256 * 1024;
constexpr int kLinkPiecesInFlight = 2;
// A float32 or float64 sum of at most this many elements travels inside
// its own check ("the check").
constexpr int64_t kInline = 256;
class Channel {
 public:
  // `check_group`: where the checks go when there is no shared memory
  // (a group of their own, so that a check never waits behind a bucket
  // still on the wire); `watch` and `lane`: where this lane says how it
  // stands (nullptr: nowhere, for a world of 1).
  Channel(GroupPtr group, torch::Device device, const Backend& backend, Check check,
          std::unique_ptr<SharedMemoryReducer> shared = nullptr, GroupPtr check_group = GroupPtr(),
          std::shared_ptr<CollectiveWatch> watch = nullptr, const std::string& lane = "bulk");
  ~Channel();

  int rank() const { return group_->getRank(); }
  int world_size() const { return group_->getSize(); }
  // Where this rank's tensors live.
  const torch::Device& device() const { return device_; }

  // Sums `tensor` over ranks in place; the future completes with it. Runs
  // asynchronously through the group (several may be in flight, completing
  // in issue order), synchronously through shared memory, the ring (see
  // "the link") or the check (up to kInline float elements).
  FuturePtr allreduce_sum(torch::Tensor tensor);
  // Whether CPU sums go through shared memory.
  bool shares_memory() const { return shared_ != nullptr; }
  // Blocking. `root` may be kAuthority.
  void broadcast(torch::Tensor& tensor, int root);
  // Every rank's `tensor` (same shape and dtype) on rank 0, in rank order, on
  // the CPU; an empty list elsewhere.
  std::vector<torch::Tensor> gather_to_rank0(const torch::Tensor& tensor);
  // Every rank's `tensor` (same shape and dtype on every rank), stacked in
  // rank order: [world_size, tensor's shape...], on tensor's device. Blocking.
  torch::Tensor allgather(const torch::Tensor& tensor);
  // Sends `out` to rank `to` while receiving `in` (as many elements, both
  // contiguous) from rank `from`, in pieces of at most `piece` elements with
  // at most `depth` pieces in flight each way; blocking.
  void exchange(const torch::Tensor& out, int to, torch::Tensor& in, int from, int64_t piece, int depth);
  void barrier();
  // Where tensors of the small blocking collectives travel: the device under
  // NCCL, the CPU under Gloo (whose every collective takes CPU tensors).
  torch::Device staging() const { return backend_.on_device ? device_ : torch::Device(torch::kCPU); }

  std::shared_ptr<StreamProbe> probe;  // see StreamProbe; set by CollectiveStream::watch

  // Who issues the collectives that follow ("DDP bucket 0's backward"):
  // the running task's issuer, for the check.
  void set_issuer(std::string issuer) { issuer_ = std::move(issuer); }
  // Compares every rank's `items` (name, value) with rank 0's, in two
  // allgathers; returns, the same on every rank, the line naming the first
  // difference ("<subject>: rank 1's fc1.weight is [512, 784] float32, rank
  // 0's is [16, 784] float32: <advice>"), or "" where all agree. The caller
  // throws it as a UsageError, outside the task where it can: every rank
  // stops at the same point, and the stream stays usable. A rank that has
  // joined (ddp.join()) says nothing and is not compared.
  std::string disagreement(const std::vector<std::pair<std::string, std::string>>& items, const std::string& subject,
                           const std::string& advice);
  // ddp.join() for this lane: serves the collectives the active ranks issue,
  // with zeros, until every rank has joined. Returns the rank that joined
  // last (the one whose lane passed the most collectives before joining).
  // Needs the check: it is how a joined rank learns what to serve.
  // `stop_everyone` (join's throw_on_early_termination): every rank throws
  // an Error naming the ranks that joined, at the first collective served.
  int serve_until_all_joined(bool stop_everyone = false);
  // Ranks that had data at this lane's last check (ddp.join()): the world
  // size unless some have joined.
  int active_ranks() const { return active_; }
  // Verifies every check still pending (Check::alongside); throws what a
  // failed one found. A no-op otherwise.
  void settle();

  // A run of collectives whose every size follows from the first's and
  // from what the ranks have already agreed (a built-in hook over one
  // bucket: its options compared at the first backward, the bucket's
  // layout when the DDP was built). While one lasts, the first collective
  // is checked and the rest, where the check goes before the transfer and
  // every rank is active, go out unchecked: PowerSGD's dependent
  // collectives pay one check's round trip, not one each.
  class DeterminedRun {
   public:
    explicit DeterminedRun(Channel& channel) : channel_(channel) { channel_.run_ = Run::first; }
    ~DeterminedRun() { channel_.run_ = Run::none; }
    DeterminedRun(const DeterminedRun&) = delete;
    DeterminedRun& operator=(const DeterminedRun&) = delete;

   private:
    Channel& channel_;
  };

 private:
  friend class CollectiveStream;  // explained(), for the futures its callers wait on
  // What a rank says of the collective it is about to issue.
  struct Described {
    Op op = Op::barrier;
    int64_t dtype = -1;  // -1: no tensor
    int64_t numel = 0;
    int root = 0;
    bool inlined = false;
    std::string what;             // "DDP bucket 0's backward (allreduce, 1181066 float32)"
    int64_t pieces[3] = {};       // its fingerprint, 16 bits a piece
  };
  // A check of Check::alongside in flight, and what it will be held to.
  struct Pending {
    uint64_t position = 0;
    Described described;
    torch::Tensor sums;
    FuturePtr done;
  };
  struct Outcome {
    int root = 0;         // kAuthority resolved
    bool served = false;  // the check carried the sum itself
  };
  // The check before each collective (see the note at the top). `inlined`,
  // where given, is a float sum that travels inside it.
  Outcome check(Op op, const torch::Tensor& tensor, int root, torch::Tensor* inlined = nullptr);
  // One check's sum over the ranks, blocking; waits as a collective of this
  // lane (the watch) does.
  void exchange_check(torch::Tensor& sums);
  // What the summed check `sums` says; throws CollectiveMismatch where the
  // active ranks differ. `mine` is nullptr for a joined rank.
  Outcome verify(const torch::Tensor& sums, const Described* mine, uint64_t position);
  [[noreturn]] void mismatch(uint64_t position, const std::string& mine);
  // A check of Check::alongside that has completed, verified; false while
  // it has not completed (`block`: waits for it).
  bool settle_oldest(bool block);
  torch::Tensor check_tensor(const Described* mine) const;
  // Waits for `work` as a collective of this lane: a stall is the watch's to
  // judge (watch.hpp), a peer lost is said in our words (explained()).
  // A send or a receive (`whole`) is waited for in one wait, not in slices:
  // Gloo's timed wait on one fails every pair of the group when it runs out.
  void await(const port::WorkPtr& work, bool whole = false);
  // A collective's transfer, after its check: await() where the backend
  // allows a wait, with the lane marked as waiting.
  void finish(const port::WorkPtr& work, bool whole = false);
  [[noreturn]] void explained(std::exception_ptr error);
  FuturePtr sum_unchecked(torch::Tensor tensor);
  void broadcast_unchecked(torch::Tensor& tensor, int root);
  std::vector<torch::Tensor> gather_unchecked(const torch::Tensor& tensor);
  torch::Tensor allgather_unchecked(const torch::Tensor& tensor);
  void issue(const char* kind, const torch::Tensor& tensor);
  torch::Tensor movable(const torch::Tensor& tensor) const;
  // Reduce-scatter then allgather round the ring rank -> rank + 1, adding in
  // float32; blocking.
  void ring_allreduce_sum(torch::Tensor& tensor);

  GroupPtr group_;
  torch::Device device_;
  const Backend& backend_;
  const Check check_;
  std::unique_ptr<SharedMemoryReducer> shared_;
  GroupPtr check_group_;
  std::shared_ptr<CollectiveWatch> watch_;
  std::shared_ptr<LaneState> lane_;
  std::string issuer_ = "a task on the stream";
  int tag_ = 0;  // point-to-point tags, the same sequence on every rank
  const int64_t inline_;  // elements of a sum the check can carry: kInline, or 0 where it never does
  int active_;            // see active_ranks()
  enum class Run { none, first, following } run_ = Run::none;  // see DeterminedRun
  // Whether this collective goes unchecked: it follows a checked one in a
  // DeterminedRun, the check goes first, and no rank has joined.
  bool follows_checked() const { return run_ == Run::following && check_ == Check::before && active_ == world_size(); }
  std::deque<std::unique_ptr<Pending>> pending_;  // Check::alongside: issued, not yet verified
};

class CollectiveStream {
 public:
  using Task = std::function<void(Channel&)>;
  using Ticket = uint64_t;

  // Starts the communication thread, which makes `device` current for
  // itself. `shared`: see Channel.
  CollectiveStream(GroupPtr group, torch::Device device, const Backend& backend, Check check,
                   std::unique_ptr<SharedMemoryReducer> shared = nullptr, GroupPtr check_group = GroupPtr(),
                   std::shared_ptr<CollectiveWatch> watch = nullptr, const std::string& lane = "bulk");
  // Runs what is still queued, stops the thread, and shuts the group down
  // (Backend::shut_down) unless a collective failed.
  ~CollectiveStream();
  CollectiveStream(const CollectiveStream&) = delete;
  CollectiveStream& operator=(const CollectiveStream&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const torch::Device& device() const { return device_; }
  // Whether CPU sums go through shared memory (see Channel).
  bool shares_memory() const { return channel_.shares_memory(); }

  // Queues `task` behind every task posted before it; never blocks on the
  // network. Any thread may post. `issuer` says who issues its collectives,
  // for the check and its messages ("SyncBatchNorm bn1's forward").
  // `skipped` is told why where the task will not run (an earlier failure,
  // abandon()), outside the stream's lock.
  using Skipped = std::function<void(std::exception_ptr)>;
  Ticket post(Task task, std::string issuer = "a task on the stream", Skipped skipped = nullptr);
  // Blocks until task `ticket` has run. Rethrows what it threw, as an
  // mnist_ddp::Error (a backend's own exception becomes a PeerLost whose
  // line says what the lane was doing, the backend's text after it). Once a
  // task has failed, later tasks are not run (no further collectives are
  // issued) and waiting on them rethrows that first failure; so does a
  // wait while another lane of this rank has found its collectives
  // mismatched (its collectives may never complete: NCCL's, checked
  // alongside); no task of this lane that has not started runs after that.
  void wait(Ticket ticket);
  // post + wait.
  void run(const Task& task, std::string issuer = "a task on the stream");
  // post(), with a future that completes with what `task` returns, or with
  // its error in our words (a task not run after an earlier failure: that
  // failure).
  std::pair<Ticket, FuturePtr> post_for(std::function<c10::IValue(Channel&)> task, std::string issuer);
  // Whether task `ticket` has run (or been skipped).
  bool finished(Ticket ticket);
  // Gives the stream up (ProcessGroup::shutdown): every wait, now and
  // later, throws `why`; no further task runs; a task still waiting on a
  // peer is left to the process's end (the stream must then never be
  // destroyed: the caller keeps it).
  void abandon(std::exception_ptr why);

  // Blocking conveniences, one task each.
  void allreduce_sum(torch::Tensor& tensor, std::string issuer = "a task on the stream");
  void broadcast(torch::Tensor& tensor, int root = 0, std::string issuer = "a task on the stream");
  std::vector<torch::Tensor> gather_to_rank0(const torch::Tensor& tensor, std::string issuer = "a task on the stream");
  torch::Tensor allgather(const torch::Tensor& tensor, std::string issuer = "a task on the stream");
  // Rank 0's `bytes` on every rank.
  void broadcast_bytes(std::vector<char>& bytes, std::string issuer = "a task on the stream");
  // Channel::disagreement, as one task.
  std::string disagreement(std::vector<std::pair<std::string, std::string>> items, std::string subject,
                           std::string advice, std::string issuer);
  void barrier(std::string issuer = "a task on the stream");

  // Hands every later post, task and collective to `probe` (nullptr: none).
  // In order with the tasks: a task posted before it runs unwatched.
  void watch(std::shared_ptr<StreamProbe> probe);

 // `error`, from a transfer of this lane's that its caller waited for
  // itself (a bucket's future), as the lane's own wait says it: another
  // lane's mismatch, a rank that ended first (uneven inputs), or `error`.
  std::exception_ptr explained(std::exception_ptr error);

 private:
  void loop();

  const int rank_, world_size_;
  const torch::Device device_;
  const Backend& backend_;
  GroupPtr group_;
  std::shared_ptr<CollectiveWatch> watch_;
  Channel channel_;

  struct Queued {
    Ticket ticket;
    Task task;
    std::string issuer;
    Skipped skipped;  // told why, where the task is not run
  };
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;
  Ticket posted_ = 0;    // tickets [0, posted_) were handed out
  Ticket finished_ = 0;  // tasks [0, finished_) have run (or were skipped)
  std::exception_ptr error_;
  Ticket failed_ = 0;    // the first failed task, when error_ is set
  bool stopping_ = false;
  std::exception_ptr abandoned_;  // abandon()'s reason
  std::shared_ptr<StreamProbe> probe_;  // the posting threads' view, under mutex_
  std::thread thread_;
};

}  // namespace mnist_ddp
