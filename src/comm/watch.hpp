// The watchdog of a process group: one thread per group that watches every
// collective still outstanding (a check, a transfer its lane waits for, a
// bucket's sum in flight, a hook's future, NCCL's work), writes the rank's
// heartbeat into the store, and gives the verdicts. Not installed.
//
// Note on verdicts. A job is ended only on evidence that no correct program
// can produce:
// - two ranks' descriptions of the same position of the same lane differ
//   (the check, collectives.hpp): a CollectiveMismatch, at once;
// - a rank has ended its program (its group is gone) before a check this
//   rank waits in: a CollectiveMismatch (uneven inputs), within a second;
// - every rank is deadlocked: each thread of each rank that has posted
//   collectives waits on one, and on no lane can any of them go on (two
//   ranks wait on different lanes for each other), as two heartbeats a
//   second apart agree: a CollectiveMismatch naming where each waits and
//   the likely cause, within seconds;
// - a rank's process has ended (shared memory sees its pid gone) or its
//   connection has closed (Gloo): a PeerLost.
// Anything else (a rank that is slow, paused in a debugger, busy with a
// checkpoint, a thread that may still post) is waited for until the
// group's timeout, and then named in a Timeout with where each rank waits.
// A wait that lasts report_after() without a verdict is reported once, on
// every rank, with where each rank waits and the likely cause, and goes on.
//
// The load on the store grows with the world: each rank writes its
// heartbeat once a second; while a collective has waited more than a
// second, each rank reads two counters twice a second ("ended", and
// "blocked": the ranks all of whose posting threads have waited a second
// or more), and every rank's heartbeat only when every rank is blocked, at
// a report or at the timeout.
#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mnist_ddp/base/errors.hpp"
#include "base/port.hpp"
#include "comm/issuer.hpp"
#include "comm/store.hpp"

namespace mnist_ddp {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// A collective that waited the group's whole timeout for a rank (Timeout's
// line names where each rank waits); a program may ask its store who went
// silent (silent_ranks()).
struct CollectiveTimedOut : Timeout {
  using Timeout::Timeout;
};

// Where one lane (a collective stream) of this rank stands. Written by the
// lane's own thread under `mutex`; read by the watchdog.
struct LaneState {
  explicit LaneState(std::string n) : name(std::move(n)) {}
  const std::string name;  // "bulk", "quick", "stream 1", ...
  std::mutex mutex;
  uint64_t passed = 0;    // checks passed on this lane so far, the same count on every rank
  bool busy = false;      // its thread runs a task
  bool waiting = false;   // its thread waits in a collective (its check or its transfer)
  bool checking = false;  // in its check: the others may not have reached it yet
  int in_flight = 0;      // transfers issued and not yet complete (a bucket's sum, a check alongside)
  Issuer issuer;          // of the collective it waits in, or of the last
  std::string what;       // "DDP bucket 0's backward (allreduce, 1181066 float32)"
};

// A lane as another rank last said it stood.
struct LaneView {
  uint64_t passed = 0;
  bool busy = false, waiting = false, checking = false;
  int in_flight = 0;
  Issuer issuer;
  std::string what;
};

// Another rank's heartbeat, read back.
struct RankView {
  int64_t count = 0;          // heartbeats written so far
  int posters = 0, blocked = 0;  // threads that have posted collectives, and those of them waiting on one
  std::map<std::string, LaneView> lanes;
};
RankView rank_view(const std::string& heartbeat);

// How a group's lines name its ranks: by their ranks in the whole job,
// and, for a group new_group() made, with the group's name before each
// line.
struct RankNames {
  std::vector<int> global;  // each rank's rank in the whole job; empty: the job's own group
  std::string group;        // "new_group 1 (ranks 1, 2)"; empty: the job's own group
  std::string rank(int r) const;                          // "rank 2"
  std::string list(const std::vector<int>& ranks) const;  // "rank 2", "ranks 1, 2"
  std::string line(const std::string& text) const;       // "in new_group 1 (ranks 1, 2): <text>"
  // How a rank that let go of the group says so: its program ended, or,
  // for a new_group(), maybe only its handle.
  std::string ended(size_t ranks) const;
};

class CollectiveWatch {
 public:
  // Starts the watchdog: "heartbeat/<rank>" in `store`, once a second, and
  // the verdicts. A write the store refuses is tried again a second later.
  CollectiveWatch(StorePtr store, int rank, int world_size, std::chrono::milliseconds timeout, RankNames names = {});
  // Stops the watchdog, waiting at most a second for it (it may be stuck on
  // a stalled store: then it is left to the process's end).
  ~CollectiveWatch();
  CollectiveWatch(const CollectiveWatch&) = delete;
  CollectiveWatch& operator=(const CollectiveWatch&) = delete;

  // A lane of this rank's, watched from now on.
  std::shared_ptr<LaneState> lane(const std::string& name);

  // How the watchdog learns that a transfer completed, and ends it on a verdict.
  enum class Ends {
    future,  // its work's future completes (Gloo's collectives)
    abort,   // its waiter waits on the work itself; a verdict aborts the work (Gloo's send and receive)
    poll,    // the watchdog polls the work; a verdict calls `abort` (NCCL: its communicator)
  };
  // Watches `work`, a transfer `lane` issued just now (past its check, or,
  // `checking`, a check itself). The future completes with the work's
  // value, or fails with its error or with the watchdog's verdict, which
  // names it. `abort`, where given, is called once on a verdict.
  FuturePtr watch(const std::shared_ptr<LaneState>& lane, const port::WorkPtr& work, Ends ends, bool checking,
                  std::function<void()> abort = nullptr);
  // Watches a future no work stands behind (a hook's): the result completes
  // with it, or fails at the timeout naming `what`.
  FuturePtr watch(const std::shared_ptr<LaneState>& lane, const FuturePtr& future, const Issuer& issuer,
                  const std::string& what);
  // A wait its caller makes itself (a barrier in shared memory): watched
  // from begin_wait() to end_wait(); verdict() throws once there is one.
  struct Wait;
  // `work`, where given, is one the caller waits on itself (a send or a
  // receive): a verdict aborts it.
  std::shared_ptr<Wait> begin_wait(const std::shared_ptr<LaneState>& lane, bool checking,
                                   const port::WorkPtr& work = {});
  void end_wait(const std::shared_ptr<Wait>& wait);
  static void verdict(const Wait& wait);

  // The calling thread posts collectives to this group's streams (counted
  // for the deadlock verdict until it ends).
  void posting();
  // While it lives, the calling thread waits on a collective of this group
  // (`watch` nullptr: none, a world of 1).
  class Blocked {
   public:
    explicit Blocked(CollectiveWatch* watch);
    ~Blocked();
    Blocked(const Blocked&) = delete;
    Blocked& operator=(const Blocked&) = delete;

   private:
    CollectiveWatch* watch_;
  };

  // A lane's collectives did not match: every lane still waiting ends with
  // `error` too, and so does every later wait.
  void mismatched(std::exception_ptr error);
  // The first mismatch any lane of this rank found, or null.
  std::exception_ptr mismatch() const;
  // ProcessGroup::shutdown(): every wait, now and later, fails with `why`,
  // and `abort` (the backends') is called once.
  void shut_down(std::exception_ptr why, std::function<void()> abort);
  bool is_shut_down() const { return shut_down_.load(); }
  // The line naming a mismatch at check `position` of `lane`: this rank
  // leaves `mine` (what it issued) in the store, reads every rank's, and
  // returns once the ranks that left theirs have read them (5 s at most
  // for each of the two waits): "rank 0 is in ...; rank 1 is in ...: <advice>".
  std::string mismatch_line(const std::string& lane, uint64_t position, const Issuer& issuer, const std::string& mine);
  // A collective of `lane` failed because a peer went away: the error in
  // our words (a rank that ended its program before this collective's check
  // is uneven inputs), else `error` itself. This rank's end is then an
  // echo of another's, and says so: no rank names it as the cause.
  std::exception_ptr explain_loss(LaneState& lane, std::exception_ptr error);
  // This rank is done with its group (`cleanly`: not while an error
  // unwinds): it says so ("clean", "error", or "echo" after a loss), with
  // where its lanes stand, so a rank waiting for it learns it will not come.
  void ended(bool cleanly);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const RankNames& names() const;
  // How long a wait lasts before it is reported: a third of the timeout, at
  // most 20 s (docs/library.md, "What is checked").
  std::chrono::milliseconds report_after() const;

 private:
  struct Watchdog;  // the thread and everything it keeps
  friend struct Watchdog;

  const int rank_, world_size_;
  const std::chrono::milliseconds timeout_;
  std::shared_ptr<Watchdog> dog_;
  mutable std::mutex mismatch_mutex_;
  std::exception_ptr mismatch_;  // the first lane's CollectiveMismatch, or shutdown()'s
  std::atomic<bool> has_mismatch_{false};
  std::atomic<bool> shut_down_{false};
  std::atomic<bool> lost_peer_{false};  // explain_loss() ran: an error end is an echo
};

}  // namespace mnist_ddp
