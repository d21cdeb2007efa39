// What each rank is doing, and what a collective that waits may conclude:
// the heartbeat every rank writes into the store, with where each of its
// lanes stands, and the answers a waiting collective gets. Not installed.
//
// Note on verdicts. A job is ended only on evidence that no correct program
// can produce:
// - two ranks' descriptions of the same position of the same lane differ
//   (the check, collectives.hpp): a CollectiveMismatch, at once;
// - a rank has ended its program (its group is gone) before a collective
//   this rank waits in: a CollectiveMismatch (uneven inputs), within a
//   second;
// - a rank's process has ended (shared memory sees its pid gone) or its
//   connection has closed (Gloo): a PeerLost.
// Anything else (a rank that is slow, paused in a debugger, busy with a
// checkpoint, waiting on another lane or thread) is waited for until the
// group's timeout, and then named in a Timeout with where each rank waits.
// The watch's load on the store grows with the world: each rank writes its
// heartbeat once a second, and a collective that has waited a second reads
// one counter twice a second; every rank's heartbeat is read only at the
// timeout.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mnist_ddp/base/errors.hpp"
#include "comm/store.hpp"

namespace mnist_ddp {

// A collective that waited the group's whole timeout for a rank (Timeout's
// line names where each rank waits); a program may ask its store who went
// silent (silent_ranks()).
struct CollectiveTimedOut : Timeout {
  using Timeout::Timeout;
};

// Where one lane (a collective stream) of this rank stands.
struct LaneState {
  explicit LaneState(std::string n) : name(std::move(n)) {}
  const std::string name;  // "bulk", "quick", "stream 1", ...
  std::mutex mutex;
  uint64_t passed = 0;    // checks passed on this lane so far, the same count on every rank
  bool waiting = false;   // in a collective now
  bool checking = false;  // in its check: the others may not have reached it yet
  std::string what;       // the collective it waits in, or the last one: "DDP bucket 0's backward (allreduce, ...)"
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
  // second, with where its lanes stand. A write the store refuses is tried
  // again a second later.
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
    int64_t ended_seen = 0;  // ranks known to have ended at the last look
  };
  // Called, every so often, by a collective of `lane` that still waits:
  // returns to keep waiting, or throws when the answer is known (the note
  // at the top), or when another lane of this rank has found its
  // collectives mismatched (the same error: one cause, every lane).
  void stalled(LaneState& lane, Wait& wait);
  // A lane's collectives did not match: every lane still waiting ends with
  // `error` too.
  void mismatched(std::exception_ptr error);
  // The first mismatch any lane of this rank found, or null.
  std::exception_ptr mismatch() const;
  // The line naming a mismatch at check `position` of `lane`: this rank
  // leaves `mine` in the store and reads every rank's (waiting a few
  // seconds at most), "rank 0 is in ...; rank 1 is in ...: <advice>".
  std::string mismatch_line(const std::string& lane, uint64_t position, const std::string& mine);
  // A collective of `lane` failed because a peer went away: the error in
  // our words (a rank that ended its program before this collective's check
  // is uneven inputs), else `error` itself.
  std::exception_ptr explain_loss(LaneState& lane, std::exception_ptr error);
  // This rank is done with its group (`cleanly`: not while an error
  // unwinds): it says so, with where its lanes stand, so a rank waiting for
  // it learns it will not come.
  void ended(bool cleanly);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

 private:
  std::map<int, std::string> read_all();
  std::map<int, std::string> read_ended();
  // The CollectiveMismatch for a peer that ended before the check `lane`
  // waits in; nullptr where none did.
  std::exception_ptr ended_before(LaneState& lane, const std::map<int, std::string>& ended);

  const int rank_, world_size_;
  const std::chrono::milliseconds timeout_;
  struct Beat;  // the heartbeat's thread and what it writes
  std::shared_ptr<Beat> beat_;
  mutable std::mutex mismatch_mutex_;
  std::exception_ptr mismatch_;  // the first lane's CollectiveMismatch
  std::atomic<bool> has_mismatch_{false};
};

// Another rank's heartbeat value read back: its lanes by name.
std::map<std::string, LaneView> lanes_of(const std::string& heartbeat);

// What to do about ranks found in the collectives `whats` describe ("the
// end of its program" for a rank that ended).
std::string mismatch_advice(const std::vector<std::string>& whats);

// What a rank that ended is said to be in.
constexpr const char* kEndOfProgram = "the end of its program";

}  // namespace mnist_ddp
