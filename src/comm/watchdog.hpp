// The watchdog's insides, shared by its three files: watch_handle.cpp (the
// handle a group holds), watchdog.cpp (the thread and its verdicts) and
// heartbeat.cpp (what a rank says of itself, read back). Not installed.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/watch.hpp"

namespace mnist_ddp {
namespace watching {

using Clock = std::chrono::steady_clock;

// Separators no description holds.
constexpr char kBeatEnd = '\x1d', kLaneEnd = '\x1e', kField = '\x1f';

// How often the watchdog wakes; how long a collective waits before the
// watchdog asks the store about it, and how often it asks then.
constexpr auto kTick = std::chrono::milliseconds(100);
constexpr auto kFirstLook = std::chrono::seconds(1);
constexpr auto kLookEvery = std::chrono::milliseconds(500);
// How long every posting thread of a rank waits before the rank counts as
// blocked, and how far apart two looks must be that find the same deadlock.
constexpr auto kBlockedAfter = std::chrono::seconds(1);
constexpr auto kDeadlockConfirm = std::chrono::milliseconds(900);
// How long a rank that found a mismatch waits for the others' words.
constexpr auto kWordsWithin = std::chrono::seconds(5);

// The group's keys (under its store's prefix).
const std::string kEnded = "ended";        // how many ranks have ended; "ended/<rank>": where its lanes stood
const std::string kBlocked = "blocked";    // how many ranks have every posting thread waiting
const std::string kDeadlock = "deadlock";  // the line of the first rank that found every rank deadlocked

std::vector<std::string> split_on(const std::string& s, char by);
// One lane as a heartbeat carries it.
std::string lane_text(LaneState& lane);
// Where a rank waits, in words ("waits in X", "last passed X", ...), for
// the messages about `lane`; `written`: it has written a heartbeat.
std::string said_of(const RankView& view, bool written, const std::string& lane);
// Where a rank waits, as the advice reads it: the collective it waits in
// (the first lane that waits), or the last it passed.
Whereabouts whereabouts_of(const RankView& view);

}  // namespace watching

// One wait the watchdog keeps, from its start until it is over.
struct CollectiveWatch::Wait {
  std::shared_ptr<LaneState> lane;
  Issuer issuer;
  std::string what;
  uint64_t position = 0;
  bool checking = false;
  watching::Clock::time_point since = watching::Clock::now();
  FuturePtr done;      // for Ends::future and watched futures: what its waiters wait on
  port::WorkPtr work;  // polled (Ends::poll) or aborted (Ends::abort) on a verdict
  Ends ends = Ends::future;
  bool promised = false;  // a future a hook returned, no transfer of ours behind it
  std::function<void()> abort;
  std::atomic<bool> over{false};  // completed, or judged
  std::mutex mutex;
  std::exception_ptr verdict;     // under mutex
};

// The thread and all it keeps: it may outlive the CollectiveWatch (left to
// the process's end while a store request hangs), so it owns what it uses.
struct CollectiveWatch::Watchdog {
  Watchdog(StorePtr store, int r, int w, std::chrono::milliseconds t, RankNames n)
      : client(std::move(store), std::min<std::chrono::milliseconds>(t, std::chrono::seconds(5)), "the store"),
        rank(r),
        world(w),
        timeout(t),
        names(std::move(n)) {}
  StoreClient client;
  const int rank, world;
  const std::chrono::milliseconds timeout;
  const RankNames names;
  std::mutex mutex;  // guards what follows
  std::condition_variable cv;
  bool stopping = false, stopped = false;
  int64_t beats = 0;
  std::vector<std::shared_ptr<LaneState>> lanes;
  std::vector<std::shared_ptr<Wait>> waits;  // outstanding
  std::map<std::thread::id, int> posters;    // each posting thread, and how many waits it is in
  std::exception_ptr failure;                // a mismatch or a shutdown: every wait ends with it
  std::function<void()> abort_all;           // shutdown()'s
  // The watchdog thread's own, between ticks.
  watching::Clock::time_point next_beat{}, next_look{}, all_blocked_since{};
  std::atomic<bool> counted_blocked{false};
  bool reported = false;
  int64_t ended_seen = 0;
  std::map<int, std::string> candidate;  // the heartbeats of a deadlock seen once, awaiting a second look
  watching::Clock::time_point candidate_at{};

  void run();
  void tick(watching::Clock::time_point now);
  std::string status();
  void publish(watching::Clock::time_point now);
  void settle_polled();
  std::vector<std::shared_ptr<Wait>> outstanding();
  void fail(const std::shared_ptr<Wait>& wait, std::exception_ptr verdict);
  void fail_all(std::exception_ptr verdict);
  void count_blocked(watching::Clock::time_point now);
  void look(const std::vector<std::shared_ptr<Wait>>& waits, watching::Clock::time_point now);
  std::map<int, std::string> read_heartbeats();
  std::map<int, std::string> read_ended();
  std::exception_ptr ended_before(const std::string& lane, uint64_t position, const Issuer& issuer,
                                  const std::string& what, const std::map<int, std::string>& ended);
  std::exception_ptr conclusive(const std::vector<std::shared_ptr<Wait>>& waits, bool long_wait, watching::Clock::time_point now);
  std::string deadlock(watching::Clock::time_point now);
  // The deadlock a rank has named, where `look` and one has.
  std::exception_ptr deadlock_found(bool look);
  void report(const Wait& oldest, watching::Clock::time_point now);
  std::exception_ptr timed_out(const Wait& wait);
  std::string where_each_waits(const std::map<int, std::string>& beats, const std::string& lane,
                               std::vector<Whereabouts>* where);
};

}  // namespace mnist_ddp
