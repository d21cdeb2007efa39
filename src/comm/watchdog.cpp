// The watchdog's thread and its verdicts (watch.hpp, "Note on verdicts").
#include "comm/watchdog.hpp"

#include <unistd.h>

#include <algorithm>
#include <set>

#include "mnist_ddp/base/errors.hpp"

namespace mnist_ddp {

using namespace watching;

void CollectiveWatch::Watchdog::run() {
  std::unique_lock<std::mutex> lock(mutex);
  while (!stopping) {
    lock.unlock();
    tick(Clock::now());
    lock.lock();
    cv.wait_for(lock, kTick, [&] { return stopping; });
  }
  stopped = true;
  cv.notify_all();
}

std::vector<std::shared_ptr<CollectiveWatch::Wait>> CollectiveWatch::Watchdog::outstanding() {
  std::lock_guard<std::mutex> lock(mutex);
  waits.erase(std::remove_if(waits.begin(), waits.end(), [](const auto& w) { return w->over.load(); }), waits.end());
  return waits;
}

void CollectiveWatch::Watchdog::fail(const std::shared_ptr<Wait>& wait, std::exception_ptr verdict) {
  {
    std::lock_guard<std::mutex> lock(wait->mutex);
    if (wait->verdict || wait->over) return;
    wait->verdict = verdict;
  }
  if (wait->ends != Ends::poll && wait->done) {
    wait->over = true;
    wait->done->setErrorIfNeeded(verdict);
  }
  if (wait->abort) wait->abort();
  if (wait->ends == Ends::abort && wait->work) wait->work->abort();
}

void CollectiveWatch::Watchdog::fail_all(std::exception_ptr verdict) {
  for (const auto& wait : outstanding()) fail(wait, verdict);
}

// NCCL's works complete on the device: the watchdog asks each whether it has.
void CollectiveWatch::Watchdog::settle_polled() {
  for (const auto& wait : outstanding()) {
    if (wait->ends != Ends::poll || !wait->work->isCompleted()) continue;
    if (!wait->over.exchange(true)) {
      std::lock_guard<std::mutex> lock(wait->lane->mutex);
      --wait->lane->in_flight;
    }
  }
}

void CollectiveWatch::Watchdog::tick(Clock::time_point now) {
  settle_polled();
  count_blocked(now);
  std::exception_ptr failed;
  {
    std::lock_guard<std::mutex> lock(mutex);
    failed = failure;
  }
  if (failed) fail_all(failed);
  const auto waits = outstanding();
  const bool long_wait = std::any_of(waits.begin(), waits.end(), [&](const auto& w) { return now - w->since >= kFirstLook; });
  if (!long_wait) {
    reported = false;
    candidate.clear();
  } else if (now >= next_look) {
    next_look = now + kLookEvery;
    look(waits, now);
  }
  publish(now);
}

// This rank counts as blocked in the store once every thread that posts
// collectives has waited on one for a second: one counter tells every rank
// whether all are, so none reads every heartbeat before that.
void CollectiveWatch::Watchdog::count_blocked(Clock::time_point now) {
  bool all = false;
  {
    std::lock_guard<std::mutex> lock(mutex);
    all = !posters.empty() && std::all_of(posters.begin(), posters.end(), [](const auto& p) { return p.second > 0; });
  }
  if (!all) all_blocked_since = now;
  const bool blocked = all && now - all_blocked_since >= kBlockedAfter;
  if (blocked == counted_blocked.load()) return;
  try {
    client.add(kBlocked, blocked ? 1 : -1);
    counted_blocked = blocked;
  } catch (const std::exception&) {
    // Tried again at the next tick.
  }
}

// The verdicts on waits that have lasted a second, in the order of the
// note in watch.hpp: a rank that ended before a check, a deadlock, then
// the report and the timeout.
void CollectiveWatch::Watchdog::look(const std::vector<std::shared_ptr<Wait>>& waits, Clock::time_point now) {
  const auto oldest = *std::min_element(waits.begin(), waits.end(), [](const auto& a, const auto& b) { return a->since < b->since; });
  try {
    if (auto verdict = conclusive(waits, now - oldest->since >= 2 * kFirstLook, now)) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (!failure) failure = verdict;
      }
      return fail_all(verdict);
    }
  } catch (const std::exception&) {
    // The store does not answer: the timeout below still holds.
  }
  if (!reported && now - oldest->since >= std::min<std::chrono::milliseconds>(std::chrono::seconds(20), timeout / 3)) {
    reported = true;
    report(*oldest, now);
  }
  for (const auto& wait : waits)
    if (now - wait->since >= timeout) fail(wait, timed_out(*wait));
}

// The verdicts that rest on evidence (the note in watch.hpp): a rank that
// ended before a check (failing the waits it concerns, at once), then a
// deadlock, which every rank names with the line of the first to find it.
std::exception_ptr CollectiveWatch::Watchdog::conclusive(const std::vector<std::shared_ptr<Wait>>& waits, bool long_wait,
                                                         Clock::time_point now) {
  // A deadlock another rank found first is the cause, whatever followed it
  // (that rank, ending, may be seen as ended before it is seen as deadlocked).
  if (auto found = deadlock_found(long_wait)) return found;
  const int64_t ended = client.add(kEnded, 0);
  if (ended != ended_seen) {
    ended_seen = ended;
    if (auto found = deadlock_found(true)) return found;
    const auto records = read_ended();
    for (const auto& wait : waits)
      if (wait->checking)
        if (auto mismatch = ended_before(wait->lane->name, wait->position, wait->issuer, wait->what, records))
          fail(wait, mismatch);
  }
  if (client.add(kBlocked, 0) + ended_seen < world) {
    candidate.clear();
    return nullptr;
  }
  const std::string line = deadlock(now);
  if (line.empty()) return nullptr;
  return std::make_exception_ptr(CollectiveMismatch(client.compare_set(kDeadlock, "", line)));
}

// A rank that ended before check `position` of `lane`, where this rank
// waits in `what`: uneven inputs, or an echo of a rank's failure. A rank
// that ended because it lost a peer itself is no cause: the ranks that
// said nothing are named beside it.
std::exception_ptr CollectiveWatch::Watchdog::ended_before(const std::string& lane, uint64_t position,
                                                           const Issuer& issuer, const std::string& what,
                                                           const std::map<int, std::string>& ended) {
  std::vector<int> who, echoes;
  std::string last;
  for (const auto& [r, record] : ended) {
    const auto lanes = rank_view(record).lanes;
    const auto theirs = lanes.find(lane);
    if (theirs != lanes.end() && theirs->second.passed > position) continue;  // it passed this check
    if (record.rfind("echo", 0) == 0) {
      echoes.push_back(r);
      continue;
    }
    if (record.rfind("clean", 0) != 0)  // it failed: its own line says why, this one only echoes it
      return std::make_exception_ptr(PeerLost(names.line(names.rank(r) + " ended with an error while " +
                                                         names.rank(rank) + " was in " + what)));
    who.push_back(r);
    if (last.empty() && theirs != lanes.end() && theirs->second.passed > 0) last = theirs->second.what;
  }
  if (who.empty() && !echoes.empty()) {
    std::vector<int> unsaid;
    for (int r = 0; r < world; ++r)
      if (r != rank && !ended.count(r)) unsaid.push_back(r);
    return std::make_exception_ptr(PeerLost(names.line(
        names.rank(rank) + " lost a peer in " + what + "; " + names.list(echoes) + " lost one too" +
        (unsaid.empty() ? std::string()
                        : "; " + names.list(unsaid) + " said nothing (killed, or " +
                              (unsaid.size() > 1 ? "their machines" : "its machine") + " lost)"))));
  }
  if (who.empty()) return nullptr;
  Whereabouts ended_there;
  ended_there.issuer.kind = kEndedKind;
  ended_there.ended = true;
  const std::string line = names.rank(rank) + " is in " + what + "; " + names.list(who) + " " + names.ended(who.size()) +
                           (last.empty() ? std::string() : " (the last collective it passed there: " + last + ")") +
                           ": " + advice_for({{issuer, false}, ended_there});
  return std::make_exception_ptr(CollectiveMismatch(names.line(line)));
}

// "rank 1 waits in ...; rank 2 last passed ..." for every other rank, and
// where each waits as the advice reads it (this rank's first).
std::string CollectiveWatch::Watchdog::where_each_waits(const std::map<int, std::string>& beats,
                                                         const std::string& lane, std::vector<Whereabouts>* where) {
  std::string out;
  for (int r = 0; r < world; ++r) {
    if (r == rank) continue;
    const RankView view = rank_view(beats.count(r) ? beats.at(r) : "");
    out += "; " + names.rank(r) + " " + said_of(view, beats.count(r) > 0, lane);
    if (where) where->push_back(whereabouts_of(view));
  }
  return out;
}

void CollectiveWatch::Watchdog::report(const Wait& oldest, Clock::time_point now) {
  std::map<int, std::string> beats;
  try {
    beats = read_heartbeats();
  } catch (const std::exception&) {
  }
  std::vector<Whereabouts> where{{oldest.issuer, false}};
  const std::string others = where_each_waits(beats, oldest.lane->name, &where);
  const auto waited = std::chrono::duration_cast<std::chrono::seconds>(now - oldest.since).count();
  const std::string line = "[" + names.rank(rank) + "] mnist_ddp: " +
                           names.line(names.rank(rank) + " has waited " + std::to_string(waited) + " s in " +
                                      oldest.what + others + "; likely cause: " + advice_for(where) +
                                      "; waiting on, up to the timeout (" + std::to_string(timeout.count() / 1000) +
                                      " s)") +
                           "\n";
  if (::write(2, line.data(), line.size()) < 0) {
    // Nowhere to say it: the timeout still names it.
  }
}

std::exception_ptr CollectiveWatch::Watchdog::timed_out(const Wait& wait) {
  if (wait.promised)
    return std::make_exception_ptr(CollectiveTimedOut(names.line(
        wait.what + " did not complete within " + std::to_string(timeout.count() / 1000) +
        " s (the timeout): a communication hook's future must complete")));
  std::map<int, std::string> beats;
  try {
    beats = read_heartbeats();
  } catch (const std::exception&) {
  }
  std::vector<int> missing;
  std::string where;
  for (int r = 0; r < world; ++r) {
    if (r == rank) continue;
    const RankView view = rank_view(beats.count(r) ? beats.at(r) : "");
    const auto here = view.lanes.find(wait.lane->name);
    if (here != view.lanes.end() && (here->second.waiting || here->second.in_flight > 0) &&
        here->second.passed == wait.position + (wait.checking ? 0 : 1))
      continue;  // it waits with this rank
    missing.push_back(r);
    where += "; " + names.rank(r) + " " + said_of(view, beats.count(r) > 0, wait.lane->name);
  }
  const std::string who = missing.empty() ? "the other ranks" : names.list(missing);
  return std::make_exception_ptr(CollectiveTimedOut(names.line(who + " did not reach " + wait.what +
                                                               (wait.checking ? "" : "'s transfer") + " within " +
                                                               std::to_string(timeout.count() / 1000) +
                                                               " s (the timeout)" + where)));
}

namespace {

// Whether ranks in `views` (those not ended) all wait on collectives, each
// on every thread that posts them, with no lane able to go on: none has a
// transfer in flight or a task at work, and no check holds every rank.
bool none_can_go_on(const std::map<int, RankView>& views, int ended) {
  std::set<std::string> names;
  for (const auto& [r, view] : views) {
    if (view.posters < 1 || view.blocked < view.posters) return false;
    for (const auto& [name, lane] : view.lanes) names.insert(name);
  }
  for (const auto& name : names) {
    std::set<uint64_t> checks;
    size_t checking = 0;
    for (const auto& [r, view] : views) {
      const auto it = view.lanes.find(name);
      if (it == view.lanes.end()) continue;
      const LaneView& lane = it->second;
      if (lane.in_flight > 0 || (lane.busy && !lane.waiting) || (lane.waiting && !lane.checking)) return false;
      if (lane.checking) {
        ++checking;
        checks.insert(lane.passed);
      }
    }
    if (ended == 0 && checking == views.size() && checks.size() == 1) return false;  // every rank in one check
  }
  return true;
}

}  // namespace

// A deadlock, once two looks a second apart find the same one, each rank's
// heartbeat written anew in between (a rank that stopped, as in a
// debugger, writes none, and is waited for).
std::string CollectiveWatch::Watchdog::deadlock(Clock::time_point now) {
  const auto beats = read_heartbeats();
  const auto ended = read_ended();
  std::map<int, RankView> views;
  for (int r = 0; r < world; ++r)
    if (!ended.count(r)) views[r] = rank_view(beats.count(r) ? beats.at(r) : "");
  if (!none_can_go_on(views, static_cast<int>(ended.size()))) {
    candidate.clear();
    return "";
  }
  bool same = !candidate.empty(), advanced = true;
  for (const auto& [r, view] : views) {
    const auto before = candidate.find(r);
    same = same && before != candidate.end() &&
           split_on(before->second, kBeatEnd).back() == split_on(beats.at(r), kBeatEnd).back();
    advanced = advanced && before != candidate.end() && rank_view(before->second).count < view.count;
  }
  if (!same) {
    candidate = beats;
    candidate_at = now;
  }
  if (!same || !advanced || now - candidate_at < kDeadlockConfirm) return "";
  std::string line;
  std::vector<Whereabouts> where;
  for (const auto& [r, view] : views) {
    line += (line.empty() ? "" : "; ") + names.rank(r) + " " + said_of(view, true, "");
    where.push_back(whereabouts_of(view));
  }
  for (const auto& [r, record] : ended) {
    line += "; " + names.rank(r) + " " + names.ended(1);
    where.push_back({Issuer(kEndedKind, 0, -1, ""), true});
  }
  return names.line(line + ", each on another stream, so none can go on: " + advice_for(where));
}

}  // namespace mnist_ddp
