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

#include "mnist_ddp/comm/process_group.hpp"
#include "base/port.hpp"
#include "comm/backends.hpp"

namespace mnist_ddp {

class SharedMemoryReducer;

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
};

// The process group as the communication thread sees it. Only tasks of a
// CollectiveStream (below) touch a Channel, so its calls are never concurrent.
//
// With a SharedMemoryReducer (every rank on this host, CPU tensors), sums
// of CPU tensors go through it and everything else through the group.
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
class Channel {
 public:
  Channel(GroupPtr group, torch::Device device, const Backend& backend,
          std::unique_ptr<SharedMemoryReducer> shared = nullptr);
  ~Channel();

  int rank() const { return group_->getRank(); }
  int world_size() const { return group_->getSize(); }
  // Where this rank's tensors live.
  const torch::Device& device() const { return device_; }

  // Sums `tensor` over ranks in place; the future completes with it. Runs
  // asynchronously through the group (several may be in flight, completing
  // in issue order), synchronously through shared memory or the ring (see
  // "the link").
  FuturePtr allreduce_sum(torch::Tensor tensor);
  // Whether CPU sums go through shared memory.
  bool shares_memory() const { return shared_ != nullptr; }
  // Blocking.
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

 private:
  void issue(const char* kind, const torch::Tensor& tensor);
  // Reduce-scatter then allgather round the ring rank -> rank + 1, adding in
  // float32; blocking.
  void ring_allreduce_sum(torch::Tensor& tensor);

  GroupPtr group_;
  torch::Device device_;
  const Backend& backend_;
  std::unique_ptr<SharedMemoryReducer> shared_;
  int tag_ = 0;  // point-to-point tags, the same sequence on every rank
};

class CollectiveStream {
 public:
  using Task = std::function<void(Channel&)>;
  using Ticket = uint64_t;

  // Starts the communication thread, which makes `device` current for
  // itself. `shared`: see Channel.
  CollectiveStream(GroupPtr group, torch::Device device, const Backend& backend,
                   std::unique_ptr<SharedMemoryReducer> shared = nullptr);
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
  // network. Any thread may post.
  Ticket post(Task task);
  // Blocks until task `ticket` has run. Rethrows what it threw. Once a task
  // has failed, later tasks are not run (no further collectives are issued)
  // and waiting on them rethrows that first failure.
  void wait(Ticket ticket);
  // post + wait.
  void run(const Task& task);

  // Blocking conveniences, one task each.
  void allreduce_sum(torch::Tensor& tensor);
  void broadcast(torch::Tensor& tensor, int root = 0);
  std::vector<torch::Tensor> gather_to_rank0(const torch::Tensor& tensor);
  torch::Tensor allgather(const torch::Tensor& tensor);
  // Rank 0's `bytes` on every rank.
  void broadcast_bytes(std::vector<char>& bytes);
  void barrier();

  // Hands every later post, task and collective to `probe` (nullptr: none).
  // In order with the tasks: a task posted before it runs unwatched.
  void watch(std::shared_ptr<StreamProbe> probe);

 private:
  void loop();

  const int rank_, world_size_;
  const torch::Device device_;
  const Backend& backend_;
  GroupPtr group_;
  Channel channel_;

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<Ticket, Task>> queue_;
  Ticket posted_ = 0;    // tickets [0, posted_) were handed out
  Ticket finished_ = 0;  // tasks [0, finished_) have run (or were skipped)
  std::exception_ptr error_;
  Ticket failed_ = 0;    // the first failed task, when error_ is set
  bool stopping_ = false;
  std::shared_ptr<StreamProbe> probe_;  // the posting threads' view, under mutex_
  std::thread thread_;
};

}  // namespace mnist_ddp
