#include "comm/watch.hpp"

#include <algorithm>
#include <thread>

#include "mnist_ddp/base/errors.hpp"

namespace mnist_ddp {
namespace {

using Clock = std::chrono::steady_clock;

// Separators no description holds.
constexpr char kBeatEnd = '\x1d', kLaneEnd = '\x1e', kField = '\x1f';

// How long a collective waits before it looks at the store, and how often
// it looks then.
constexpr auto kFirstLook = std::chrono::seconds(1);
constexpr auto kLookEvery = std::chrono::milliseconds(500);
// How long a rank that found a mismatch waits for the others' words.
constexpr auto kWordsWithin = std::chrono::seconds(5);

const std::string kEnded = "ended";  // how many ranks have ended; "ended/<rank>": where its lanes stood

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
  return end == std::string::npos ? heartbeat : heartbeat.substr(end + 1);
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string who;
  for (int r : ranks) who += (who.empty() ? "" : ", ") + std::to_string(r);
  return (ranks.size() > 1 ? "ranks " : "rank ") + who;
}

bool contains(const std::string& text, const char* piece) { return text.find(piece) != std::string::npos; }

}  // namespace

struct CollectiveWatch::Beat {
  explicit Beat(StoreClient c, std::string k) : client(std::move(c)), key(std::move(k)) {}
  StoreClient client;
  const std::string key;
  std::mutex mutex;
  std::condition_variable cv;
  bool stopping = false, stopped = false;
  int64_t count = 0;
  std::vector<std::shared_ptr<LaneState>> lanes;  // under mutex

  std::string status() {
    std::vector<std::shared_ptr<LaneState>> live;
    {
      std::lock_guard<std::mutex> lock(mutex);
      live = lanes;
    }
    std::string out;
    for (const auto& lane : live) {
      std::lock_guard<std::mutex> lock(lane->mutex);
      if (!out.empty()) out += kLaneEnd;
      out += lane->name + kField + std::to_string(lane->passed) + kField + (lane->waiting ? "1" : "0") + kField + lane->what;
    }
    return out;
  }

  // Writes the heartbeat once; false when the store refused it.
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

  // Once a second until stopped; a store that refuses a write (busy, or
  // stalled for a while) is tried again the next second.
  static void run(const std::shared_ptr<Beat>& beat) {
    std::unique_lock<std::mutex> lock(beat->mutex);
    while (!beat->stopping) {
      lock.unlock();
      beat->publish();
      lock.lock();
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

std::map<int, std::string> CollectiveWatch::read_ended() {
  std::map<int, std::string> ended;
  for (int r = 0; r < world_size_; ++r) {
    const std::string key = kEnded + "/" + std::to_string(r);
    if (r != rank_ && beat_->client.check({key})) ended[r] = beat_->client.get(key);
  }
  return ended;
}

void CollectiveWatch::ended(bool cleanly) {
  try {
    beat_->client.set(kEnded + "/" + std::to_string(rank_), (cleanly ? "clean" : "error") + std::string(1, kBeatEnd) +
                                                                beat_->status());
    beat_->client.add(kEnded, 1);
  } catch (const std::exception&) {
    // The store is gone: so is the job; nobody waits to be told.
  }
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
  auto any = [&](auto pred) { return std::any_of(whats.begin(), whats.end(), pred); };
  auto all = [&](auto pred) { return std::all_of(whats.begin(), whats.end(), pred); };
  auto training = [](const std::string& w) {  // a collective of a training step's
    return contains(w, "DDP bucket") || contains(w, "DDP's bucket") || contains(w, "SyncBatchNorm") ||
           contains(w, "DistributedDataParallel's buffers") || contains(w, "GradScaler");
  };
  auto sampling = [](const std::string& w) {  // a train-mode forward without autograd: sampling, evaluating
    return contains(w, "SyncBatchNorm") && contains(w, "'s forward without autograd");
  };
  auto forward = [](const std::string& w) { return contains(w, "SyncBatchNorm") && contains(w, "'s forward"); };
  auto bucket = [](const std::string& w) { return contains(w, "DDP bucket") || contains(w, "DDP's bucket"); };
  const std::string syncbn =
      "a train-mode forward through SyncBatchNorm must run on every rank (evaluate or sample under eval(), or on "
      "every rank)";
  if (any(sampling)) return syncbn;
  if (any(training) && !all(training))
    return "the ranks ran different numbers of steps (uneven inputs): give every rank as many batches, or wrap "
           "each rank's training loop in ddp.join()";
  if (any(forward)) return syncbn;
  if (all(bucket)) return "every rank must build the same model and register the same communication hook";
  return "every rank must issue the same collectives in the same order (docs/library.md, \"What is checked\")";
}

void CollectiveWatch::mismatched(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mismatch_mutex_);
  if (!mismatch_) mismatch_ = std::move(error);
  has_mismatch_ = true;
}

std::exception_ptr CollectiveWatch::mismatch() const {
  if (!has_mismatch_) return nullptr;
  std::lock_guard<std::mutex> lock(mismatch_mutex_);
  return mismatch_;
}

std::string CollectiveWatch::mismatch_line(const std::string& lane, uint64_t position, const std::string& mine) {
  const std::string prefix = "check/" + lane + "/" + std::to_string(position) + "/";
  std::vector<std::string> whats(static_cast<size_t>(world_size_));
  whats[static_cast<size_t>(rank_)] = mine;
  try {
    beat_->client.set(prefix + std::to_string(rank_), mine);
    std::vector<std::string> keys;
    for (int r = 0; r < world_size_; ++r) keys.push_back(prefix + std::to_string(r));
    beat_->client.wait(keys, kWordsWithin);
    for (int r = 0; r < world_size_; ++r)
      if (r != rank_ && beat_->client.check({keys[r]})) whats[r] = beat_->client.get(keys[r]);
  } catch (const std::exception&) {
    // The store does not answer: the line says what this rank knows.
  }
  std::string line;
  std::vector<std::string> said;
  for (int r = 0; r < world_size_; ++r) {
    const std::string& what = whats[static_cast<size_t>(r)];
    if (what.empty()) continue;
    line += (line.empty() ? "rank " : "; rank ") + std::to_string(r) + " is in " + what;
    said.push_back(what);
  }
  return line + ": " + mismatch_advice(said);
}

std::exception_ptr CollectiveWatch::ended_before(LaneState& lane, const std::map<int, std::string>& ended) {
  std::string mine;
  uint64_t passed;
  {
    std::lock_guard<std::mutex> lock(lane.mutex);
    if (!lane.checking) return nullptr;  // past the check: every rank reached this collective
    mine = lane.what;
    passed = lane.passed;
  }
  std::vector<int> who;
  std::string last;
  for (const auto& [r, record] : ended) {
    const auto lanes = lanes_of(record);
    const auto theirs = lanes.find(lane.name);
    if (theirs != lanes.end() && theirs->second.passed > passed) continue;  // it passed this check: not the one missing
    if (record.rfind("clean", 0) != 0)  // it failed: its own line says why, this one only echoes it
      return std::make_exception_ptr(PeerLost("rank " + std::to_string(r) + " ended with an error while rank " +
                                              std::to_string(rank_) + " was in " + mine));
    who.push_back(r);
    if (last.empty() && theirs != lanes.end() && theirs->second.passed > 0) last = theirs->second.what;
  }
  if (who.empty()) return nullptr;
  const std::string line = "rank " + std::to_string(rank_) + " is in " + mine + "; " + ranks_text(who) + " ended " +
                           (who.size() > 1 ? "their programs" : "its program") +
                           (last.empty() ? std::string() : " (the last collective it passed there: " + last + ")") +
                           ": " + mismatch_advice({mine, kEndOfProgram});
  return std::make_exception_ptr(CollectiveMismatch(line));
}

std::exception_ptr CollectiveWatch::explain_loss(LaneState& lane, std::exception_ptr error) {
  try {
    if (auto mismatch = ended_before(lane, read_ended())) return mismatch;
  } catch (const std::exception&) {
    // The store is gone with the peer: the loss is all there is to say.
  }
  return error;
}

void CollectiveWatch::stalled(LaneState& lane, Wait& wait) {
  if (auto error = mismatch()) std::rethrow_exception(error);
  const auto now = Clock::now();
  if (now - wait.since < kFirstLook || now < wait.next_look) return;
  wait.next_look = now + kLookEvery;
  try {
    // A rank that ended its program will never come: one counter says
    // whether any did since the last look.
    const int64_t ended = beat_->client.add(kEnded, 0);
    if (ended != wait.ended_seen) {
      wait.ended_seen = ended;
      if (auto mismatch = ended_before(lane, read_ended())) std::rethrow_exception(mismatch);
    }
  } catch (const CollectiveMismatch&) {
    throw;
  } catch (const std::exception&) {
    // The store does not answer: the timeout below still holds.
  }
  if (now - wait.since < timeout_) return;
  // The timeout: who did not come, and where each of them is.
  std::string mine;
  uint64_t passed;
  bool checking;
  {
    std::lock_guard<std::mutex> lock(lane.mutex);
    mine = lane.what;
    passed = lane.passed;
    checking = lane.checking;
  }
  std::map<int, std::string> all;
  try {
    all = read_all();
  } catch (const std::exception&) {
  }
  std::vector<int> missing;
  std::string where;
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    const auto lanes = lanes_of(all.count(r) ? all.at(r) : "");
    const auto here = lanes.find(lane.name);
    if (here != lanes.end() && here->second.waiting && here->second.passed == passed) continue;  // with this rank
    missing.push_back(r);
    std::string waits_in;
    for (const auto& [name, view] : lanes)
      if (view.waiting) waits_in = view.what;
    std::string said = !waits_in.empty() ? "waits in " + waits_in
                       : here != lanes.end() && !here->second.what.empty() ? "last passed " + here->second.what
                       : all.count(r) ? "said nothing of this stream in its last heartbeat"
                                      : "has written no heartbeat";
    where += "; rank " + std::to_string(r) + " " + said;
  }
  const std::string who = missing.empty() ? "the other ranks" : ranks_text(missing);
  throw CollectiveTimedOut(who + " did not reach " + mine + (checking ? "" : "'s transfer") + " within " +
                std::to_string(timeout_.count() / 1000) + " s (the timeout)" + where);
}

}  // namespace mnist_ddp
