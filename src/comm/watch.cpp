#include "comm/watch.hpp"

#include <algorithm>
#include <sstream>
#include <thread>

#include "mnist_ddp/base/errors.hpp"

namespace mnist_ddp {
namespace {

using Clock = std::chrono::steady_clock;

// Separators no description holds.
constexpr char kBeatEnd = '\x1d', kLaneEnd = '\x1e', kField = '\x1f';

// When a waiting collective first looks at the others, and how far apart
// its two looks are: each spans more than two heartbeats, so a rank's
// status has been written since, unless it is gone.
constexpr auto kFirstLook = std::chrono::seconds(2);
constexpr auto kLookApart = std::chrono::milliseconds(2500);

// Where the first rank to find its collectives stuck leaves its line for
// the others, and where each says it read it.
const std::string kVerdict = "collectives/verdict";

std::vector<std::string> split(const std::string& s, char by) {
  std::vector<std::string> parts;
  size_t at = 0;
  for (size_t next; (next = s.find(by, at)) != std::string::npos; at = next + 1) parts.push_back(s.substr(at, next - at));
  parts.push_back(s.substr(at));
  return parts;
}

// A heartbeat without its counter: what a rank says of its lanes.
std::string status_part(const std::string& heartbeat) {
  const size_t end = heartbeat.find(kBeatEnd);
  return end == std::string::npos ? "" : heartbeat.substr(end + 1);
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string who;
  for (int r : ranks) who += (who.empty() ? "" : ", ") + std::to_string(r);
  return (ranks.size() > 1 ? "ranks " : "rank ") + who;
}

}  // namespace

struct CollectiveWatch::Beat {
  explicit Beat(StoreClient c, std::string k) : client(std::move(c)), key(std::move(k)) {}
  StoreClient client;
  const std::string key;
  std::mutex mutex;
  std::condition_variable cv;
  bool stopping = false, stopped = false;
  int64_t count = 0;
  std::vector<std::weak_ptr<LaneState>> lanes;  // under mutex

  std::string status() {
    std::vector<std::shared_ptr<LaneState>> live;
    {
      std::lock_guard<std::mutex> lock(mutex);
      for (const auto& l : lanes)
        if (auto lane = l.lock()) live.push_back(std::move(lane));
    }
    std::string out;
    for (const auto& lane : live) {
      std::lock_guard<std::mutex> lock(lane->mutex);
      if (!out.empty()) out += kLaneEnd;
      out += lane->name + kField + std::to_string(lane->passed) + kField + (lane->waiting ? "1" : "0") + kField + lane->what;
    }
    return out;
  }

  // Writes the heartbeat once; false when the store is gone or stalled.
  bool publish() {
    int64_t n;
    {
      std::lock_guard<std::mutex> lock(mutex);
      n = ++count;
    }
    try {
      client.set(key, std::to_string(n) + kBeatEnd + status());
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }

  static void run(const std::shared_ptr<Beat>& beat) {
    std::unique_lock<std::mutex> lock(beat->mutex);
    while (!beat->stopping) {
      lock.unlock();
      const bool written = beat->publish();
      lock.lock();
      if (!written) break;  // someone will say so
      beat->cv.wait_for(lock, std::chrono::seconds(1), [&] { return beat->stopping; });
    }
    beat->stopped = true;
    beat->cv.notify_all();
  }
};

CollectiveWatch::CollectiveWatch(StorePtr store, int rank, int world_size, std::chrono::milliseconds timeout)
    : rank_(rank),
      world_size_(world_size),
      timeout_(timeout),
      beat_(std::make_shared<Beat>(StoreClient(std::move(store), std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(5)),
                                               "the store"),
                                   "heartbeat/" + std::to_string(rank))) {
  std::thread([beat = beat_] { Beat::run(beat); }).detach();
}

CollectiveWatch::~CollectiveWatch() {
  std::unique_lock<std::mutex> lock(beat_->mutex);
  beat_->stopping = true;
  beat_->cv.notify_all();
  beat_->cv.wait_for(lock, std::chrono::seconds(1), [this] { return beat_->stopped; });
}

std::shared_ptr<LaneState> CollectiveWatch::lane(const std::string& name) {
  auto lane = std::make_shared<LaneState>(name);
  std::lock_guard<std::mutex> lock(beat_->mutex);
  beat_->lanes.push_back(lane);
  return lane;
}

std::map<int, std::string> CollectiveWatch::read_all() {
  std::map<int, std::string> all;
  for (int r = 0; r < world_size_; ++r) {
    const std::string key = "heartbeat/" + std::to_string(r);
    if (beat_->client.check({key})) all[r] = beat_->client.get(key);
  }
  return all;
}

std::map<std::string, LaneView> lanes_of(const std::string& heartbeat) {
  std::map<std::string, LaneView> lanes;
  const std::string status = status_part(heartbeat);
  if (status.empty()) return lanes;
  for (const auto& lane : split(status, kLaneEnd)) {
    const auto f = split(lane, kField);
    if (f.size() != 4) continue;
    LaneView v;
    try {
      v.passed = std::stoull(f[1]);
    } catch (const std::exception&) {
      continue;
    }
    v.waiting = f[2] == "1";
    v.what = f[3];
    lanes[f[0]] = v;
  }
  return lanes;
}

std::string mismatch_advice(const std::vector<std::string>& whats) {
  auto training = [](const std::string& w) {  // a collective of a training step's
    return w.find("DDP bucket") != std::string::npos || w.find("SyncBatchNorm") != std::string::npos ||
           w.find("DistributedDataParallel's buffers") != std::string::npos || w.find("GradScaler") != std::string::npos;
  };
  auto forward = [](const std::string& w) {
    return w.find("SyncBatchNorm") != std::string::npos && w.find("'s forward") != std::string::npos;
  };
  const bool some_training = std::any_of(whats.begin(), whats.end(), training);
  const bool all_training = std::all_of(whats.begin(), whats.end(), training);
  if (some_training && !all_training)
    return "the ranks ran different numbers of steps (uneven inputs): give every rank as many batches, or wrap "
           "each rank's training loop in ddp.join()";
  if (std::any_of(whats.begin(), whats.end(), forward))
    return "a train-mode forward through SyncBatchNorm must run on every rank (evaluate or sample under eval(), "
           "or on every rank)";
  if (std::all_of(whats.begin(), whats.end(), [](const std::string& w) { return w.find("DDP bucket") != std::string::npos; }))
    return "every rank must build the same model and register the same communication hook";
  return "every rank must issue the same collectives in the same order (docs/library.md, \"What is checked\")";
}

void CollectiveWatch::mismatched(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mismatch_mutex_);
  if (!mismatch_) mismatch_ = std::move(error);
  has_mismatch_ = true;
}

void CollectiveWatch::end_with(const std::string& verdict) {
  // The others may look a little later than this rank did, and a launcher
  // stops every rank once one has ended: so the first verdict goes to the
  // store, each rank says it has read it (every stalled() call looks), and
  // every rank ends once all have, within a few seconds, with the same line.
  std::string line = verdict;
  try {
    line = beat_->client.compare_set(kVerdict, "", verdict);
    beat_->client.set(kVerdict + "/seen/" + std::to_string(rank_), "1");
    std::vector<std::string> seen;
    for (int r = 0; r < world_size_; ++r) seen.push_back(kVerdict + "/seen/" + std::to_string(r));
    beat_->client.wait(seen, std::chrono::seconds(3));
  } catch (const std::exception&) {
  }
  const CollectiveMismatch error(line);
  mismatched(std::make_exception_ptr(error));  // this rank's other lanes end with it too
  throw error;
}

void CollectiveWatch::stalled(LaneState& lane, Wait& wait) {
  if (has_mismatch_) {
    std::lock_guard<std::mutex> lock(mismatch_mutex_);
    std::rethrow_exception(mismatch_);
  }
  const auto now = Clock::now();
  if (now - wait.since < kFirstLook) return;
  // Another rank's verdict, if one has come: this rank ends with it. Looked
  // for ten times a second (a shared-memory wait calls this every 5 ms).
  if (now >= wait.next_verdict) {
    wait.next_verdict = now + std::chrono::milliseconds(100);
    try {
      if (beat_->client.check({kVerdict})) end_with(beat_->client.get(kVerdict));
    } catch (const CollectiveMismatch&) {
      throw;
    } catch (const std::exception&) {
      return;  // the store does not answer: the wait's own timeout will say so
    }
  }
  if (now < wait.next_look) return;
  wait.next_look = now + std::chrono::milliseconds(500);
  std::string mine;
  uint64_t passed;
  {
    std::lock_guard<std::mutex> lock(lane.mutex);
    mine = lane.what;
    passed = lane.passed;
  }
  std::map<int, std::string> all;
  try {
    beat_->publish();  // where this rank waits, for the others' looks
    all = read_all();
  } catch (const std::exception&) {
    return;  // the store does not answer: the wait's own timeout will say so
  }
  if (!wait.first) {
    wait.first = all;
    wait.first_at = now;
    return;
  }
  if (now - wait.first_at < kLookApart) return;
  // Gone: no heartbeat since the first look.
  std::vector<int> gone;
  for (int r = 0; r < world_size_; ++r)
    if (r != rank_ && all.count(r) && wait.first->count(r) && all.at(r) == wait.first->at(r)) gone.push_back(r);
  if (!gone.empty())
    throw PeerLost("lost " + ranks_text(gone) + ": no heartbeat for " +
                   std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now - wait.first_at).count()) +
                   " s while rank " + std::to_string(rank_) + " waited in " + mine);
  // Who is with this rank, who waits in another collective, who is elsewhere.
  bool stuck = true;
  std::map<int, std::string> in;  // rank -> the collective it waits in
  in[rank_] = mine;
  std::vector<int> elsewhere;
  std::string last_seen;
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    const auto lanes = lanes_of(all.count(r) ? all.at(r) : "");
    const auto here = lanes.find(lane.name);
    if (here != lanes.end() && here->second.waiting && here->second.passed == passed) {
      in[r] = mine;  // with this rank
      continue;
    }
    const bool same = all.count(r) && wait.first->count(r) && status_part(all.at(r)) == status_part(wait.first->at(r));
    std::string waits_in;
    for (const auto& [name, view] : lanes)
      if (view.waiting) waits_in = view.what;
    if (!waits_in.empty() && same) {
      in[r] = waits_in;
    } else {
      stuck = false;
      elsewhere.push_back(r);
      if (here != lanes.end() && last_seen.empty()) last_seen = here->second.what;
    }
  }
  if (stuck) {  // the same line on every rank: ranks in order
    std::string line;
    std::vector<std::string> whats;
    for (const auto& [r, what] : in) {
      line += (line.empty() ? "rank " : "; rank ") + std::to_string(r) + " is in " + what;
      whats.push_back(what);
    }
    end_with(line + ": " + mismatch_advice(whats));
  }
  if (now - wait.since >= timeout_)
    throw Timeout(ranks_text(elsewhere) + " alive but did not reach " + mine + " within " +
                  std::to_string(timeout_.count() / 1000) + " s (the timeout)" +
                  (last_seen.empty() ? std::string() : "; the last collective it passed there: " + last_seen));
  wait.first = all;
  wait.first_at = now;
}

}  // namespace mnist_ddp
