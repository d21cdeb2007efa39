// Sums over the ranks of one host through a shared-memory segment.
//
// Why: Gloo carries every collective through the loopback TCP stack and
// wakes a thread or two on each side of it. On a CPU job each worker has its
// own core and nothing else to run there, so that costs a step what the
// exchange itself does not: about 2 ms per SyncBatchNorm round trip and 7 ms
// for the 4.8 MB of gradients on the 2-core machine. Here a rank copies its
// tensor into its slot of the segment, waits for the others at a barrier
// (spinning briefly, then sleeping on a futex), and reads the sum back.
//
// Every element is summed in rank order, 0 first, by one rank, and every rank
// reads that one result: replicas stay bit-identical whatever each rank's
// threads. float16 and bfloat16 are summed in float32 and rounded once.
//
// Peers that die are noticed within milliseconds (their pids, checked while
// waiting); a rank that does not arrive within the timeout is named.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "comm/watch.hpp"

namespace mnist_ddp {

class SharedMemoryReducer {
 public:
  // Collective over the `world_size` ranks, which must all run on this host
  // (one kernel: pids and /dev/shm are shared). Rank 0 creates the segment
  // and publishes its name under "shared_memory" in `store`; every rank maps
  // it and then calls `barrier` (a barrier over the ranks, which must not use
  // this reducer); after it, rank 0 removes the name, so nothing is left in
  // /dev/shm whatever becomes of the job. Throws std::runtime_error with one
  // line (no /dev/shm, or no room in it). `names` says the ranks as the
  // job numbers them (a new_group()'s differ).
  SharedMemoryReducer(c10d::Store& store, int rank, int world_size, std::chrono::milliseconds timeout,
                      const std::function<void()>& barrier, RankNames names = {});
  ~SharedMemoryReducer();
  SharedMemoryReducer(const SharedMemoryReducer&) = delete;
  SharedMemoryReducer& operator=(const SharedMemoryReducer&) = delete;

  // Replaces `tensor` (CPU, contiguous) with its sum over the ranks. Every
  // rank calls it with the same numel and dtype, in the same order as its
  // other calls; one thread at a time. Blocks until this rank's sum is in
  // place. Throws PeerLost when a rank's process ended and Timeout naming
  // the ranks that did not arrive within the timeout.
  // `stalled`, where given, is called every few milliseconds while a
  // barrier waits for a peer, and may throw to end the wait; it then names
  // the timeout too (this call throws Timeout only without it).
  void allreduce_sum(at::Tensor& tensor, const std::function<void()>& stalled = nullptr);
  // Replaces `tensor` (CPU, contiguous) with rank `root`'s, byte for byte;
  // as allreduce_sum otherwise.
  void broadcast(at::Tensor& tensor, int root, const std::function<void()>& stalled = nullptr);
  // Returns once every rank has called it; as allreduce_sum otherwise.
  void barrier(const std::function<void()>& stalled = nullptr);

 private:
  bool all_arrived(uint64_t barrier) const;
  void check_peers(uint64_t barrier, std::chrono::steady_clock::time_point deadline) const;
  char* slot(int set, int rank) const;

  const int rank_, world_size_;
  const std::chrono::milliseconds timeout_;
  const RankNames names_;
  size_t slot_bytes_ = 0;  // what one rank puts in the segment at a time; larger tensors go in pieces
  size_t size_ = 0;       // of the mapping
  char* base_ = nullptr;  // the mapping
  uint64_t barriers_ = 0; // barriers this rank has entered, the same count on every rank
  int set_ = 0;           // which of the two slot sets the next piece uses
};

}  // namespace mnist_ddp
