// What each rank is doing, and who is stuck: the heartbeat every rank
// writes into the store, with where each of its lanes stands, and the
// diagnosis a collective that waits too long asks for. Not installed.
//
// Note on mismatched collectives. Every collective is checked before it is
// issued (collectives.hpp, "the check"): ranks that reach the same point of
// a lane with different collectives learn it at once, from each other. What
// that check cannot see is a rank that never reaches the point: it is
// elsewhere in its program, waiting in a collective on another lane (a
// SyncBatchNorm forward on one rank while the others are in backward), or
// gone. So every rank writes, once a second, its heartbeat and, for each
// lane, how many collectives it has passed and whether it waits in one
// (which one); a collective that has waited more than a few seconds reads
// every rank's, twice, a few seconds apart, and ends the wait in one line
// when the answer is known: ranks stuck in collectives that cannot meet (a
// CollectiveMismatch naming what each waits in), a rank whose heartbeat
// stopped (PeerLost), and, at the group's timeout, a rank alive but
// elsewhere (Timeout, naming its last collective).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/store.hpp"

namespace mnist_ddp {

// Where one lane (a collective stream) of this rank stands.
struct LaneState {
  explicit LaneState(std::string n) : name(std::move(n)) {}
  const std::string name;  // "bulk", "quick", "stream 1", ...
  std::mutex mutex;
  uint64_t passed = 0;  // collectives checked on this lane so far, the same count on every rank
  bool waiting = false;  // in a collective's check now
  std::string what;      // the collective it waits in, or the last one: "DDP bucket 0's backward (allreduce, ...)"
};

// A lane as another rank last said it stood.
struct LaneView {
  uint64_t passed = 0;
  bool waiting = false;
  std::string what;
};

class CollectiveWatch {
 public:
  // Starts this rank's heartbeat: "heartbeat/<rank>" in `store`, once a
  // second, with where its lanes stand.
  CollectiveWatch(StorePtr store, int rank, int world_size, std::chrono::milliseconds timeout);
  // Stops the heartbeat, waiting at most a second for it (it may be stuck on
  // a stalled store: then it is left to the process's end).
  ~CollectiveWatch();
  CollectiveWatch(const CollectiveWatch&) = delete;
  CollectiveWatch& operator=(const CollectiveWatch&) = delete;

  // A lane of this rank's, watched from now on.
  std::shared_ptr<LaneState> lane(const std::string& name);

  // What a collective that waits keeps between its calls of stalled().
  struct Wait {
    std::chrono::steady_clock::time_point since = std::chrono::steady_clock::now();
    std::chrono::steady_clock::time_point next_look{};
    std::chrono::steady_clock::time_point next_verdict{};  // when to look for another rank's verdict
    std::optional<std::map<int, std::string>> first;  // every rank's heartbeat at the first look
    std::chrono::steady_clock::time_point first_at{};
  };
  // Called, every so often, by a collective on `lane` that still waits:
  // returns to keep waiting, or throws when the answer is known (see the
  // note at the top), or when another lane of this rank has found its
  // collectives mismatched (the same error: one cause, every lane).
  void stalled(LaneState& lane, Wait& wait);
  // A lane's collectives did not match: every lane still waiting ends with
  // `error` too.
  void mismatched(std::exception_ptr error);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

 private:
  std::map<int, std::string> read_all();
  // Throws the CollectiveMismatch every stuck rank ends with: the first
  // rank's `verdict`, once every rank has read it (a few seconds at most).
  [[noreturn]] void end_with(const std::string& verdict);

  const int rank_, world_size_;
  const std::chrono::milliseconds timeout_;
  struct Beat;  // the heartbeat's thread and what it writes
  std::shared_ptr<Beat> beat_;
  std::mutex mismatch_mutex_;
  std::exception_ptr mismatch_;  // the first lane's CollectiveMismatch
  std::atomic<bool> has_mismatch_{false};
};

// Another rank's heartbeat value read back: its lanes by name.
std::map<std::string, LaneView> lanes_of(const std::string& heartbeat);

// What to do about ranks found in the collectives `whats` describe.
std::string mismatch_advice(const std::vector<std::string>& whats);

}  // namespace mnist_ddp
