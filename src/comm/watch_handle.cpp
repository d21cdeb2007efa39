// The watchdog's handle (watch.hpp): what a group and its lanes ask of it;
// the thread and its verdicts are in watchdog.cpp.
#include "comm/watchdog.hpp"

#include <algorithm>

#include "mnist_ddp/base/errors.hpp"

namespace mnist_ddp {

using namespace watching;

CollectiveWatch::CollectiveWatch(StorePtr store, int rank, int world_size, std::chrono::milliseconds timeout,
                                 RankNames names)
    : rank_(rank), world_size_(world_size), timeout_(timeout),
      dog_(std::make_shared<Watchdog>(std::move(store), rank, world_size, timeout, std::move(names))) {
  std::thread([dog = dog_] { dog->run(); }).detach();
}

CollectiveWatch::~CollectiveWatch() {
  std::unique_lock<std::mutex> lock(dog_->mutex);
  dog_->stopping = true;
  dog_->cv.notify_all();
  dog_->cv.wait_for(lock, std::chrono::seconds(1), [this] { return dog_->stopped; });
}

const RankNames& CollectiveWatch::names() const { return dog_->names; }

std::chrono::milliseconds CollectiveWatch::report_after() const {
  return std::min<std::chrono::milliseconds>(std::chrono::seconds(20), timeout_ / 3);
}

std::shared_ptr<LaneState> CollectiveWatch::lane(const std::string& name) {
  auto lane = std::make_shared<LaneState>(name);
  std::lock_guard<std::mutex> lock(dog_->mutex);
  dog_->lanes.push_back(lane);
  return lane;
}

namespace {

// A new wait of `lane`, as the lane stands now.
template <typename Wait>
std::shared_ptr<Wait> wait_of(const std::shared_ptr<LaneState>& lane, bool checking) {
  auto wait = std::make_shared<Wait>();
  wait->lane = lane;
  wait->checking = checking;
  std::lock_guard<std::mutex> lock(lane->mutex);
  wait->issuer = lane->issuer;
  wait->what = lane->what;
  // A check waits at the position it will pass; a transfer follows the check it passed.
  wait->position = checking || lane->passed == 0 ? lane->passed : lane->passed - 1;
  return wait;
}

}  // namespace

FuturePtr CollectiveWatch::watch(const std::shared_ptr<LaneState>& lane, const port::WorkPtr& work, Ends ends,
                                 bool checking, std::function<void()> abort) {
  auto wait = wait_of<Wait>(lane, checking);
  wait->work = work;
  wait->ends = ends;
  wait->abort = std::move(abort);
  FuturePtr result;
  if (ends == Ends::future) {
    const FuturePtr source = work->getFuture();
    wait->done = c10::make_intrusive<c10::ivalue::Future>(source->elementType(), source->devices());
    result = wait->done;
  } else if (ends == Ends::poll) {
    result = work->getFuture();
  }
  {
    std::lock_guard<std::mutex> lock(lane->mutex);
    ++lane->in_flight;
  }
  std::exception_ptr failed;
  {
    std::lock_guard<std::mutex> lock(dog_->mutex);
    failed = dog_->failure;
    dog_->waits.push_back(wait);
  }
  if (ends == Ends::future)
    work->getFuture()->addCallback([wait](c10::ivalue::Future& source) {
      {
        std::lock_guard<std::mutex> lock(wait->lane->mutex);
        --wait->lane->in_flight;
      }
      if (wait->over.exchange(true)) return;  // judged first
      if (source.hasError()) wait->done->setErrorIfNeeded(source.exception_ptr());
      else wait->done->markCompleted(source.value());
    });
  if (failed) dog_->fail(wait, failed);  // the group has failed: this ends at once too
  return result;
}

FuturePtr CollectiveWatch::watch(const std::shared_ptr<LaneState>& lane, const FuturePtr& future, const Issuer& issuer,
                                 const std::string& what) {
  if (future->completed()) return future;
  auto wait = wait_of<Wait>(lane, false);
  wait->issuer = issuer;
  wait->what = what;
  wait->promised = true;
  wait->done = c10::make_intrusive<c10::ivalue::Future>(future->elementType(), future->devices());
  {
    std::lock_guard<std::mutex> lock(lane->mutex);
    ++lane->in_flight;  // another rank's part in it may still be to come
  }
  {
    std::lock_guard<std::mutex> lock(dog_->mutex);
    dog_->waits.push_back(wait);
  }
  future->addCallback([wait](c10::ivalue::Future& source) {
    {
      std::lock_guard<std::mutex> lock(wait->lane->mutex);
      --wait->lane->in_flight;
    }
    if (wait->over.exchange(true)) return;
    if (source.hasError()) wait->done->setErrorIfNeeded(source.exception_ptr());
    else wait->done->markCompleted(source.value());
  });
  return wait->done;
}

std::shared_ptr<CollectiveWatch::Wait> CollectiveWatch::begin_wait(const std::shared_ptr<LaneState>& lane, bool checking,
                                                                   const port::WorkPtr& work) {
  auto wait = wait_of<Wait>(lane, checking);
  wait->ends = Ends::abort;
  wait->work = work;
  std::exception_ptr failed;
  {
    std::lock_guard<std::mutex> lock(dog_->mutex);
    failed = dog_->failure;
    dog_->waits.push_back(wait);
  }
  if (failed) dog_->fail(wait, failed);
  return wait;
}

void CollectiveWatch::end_wait(const std::shared_ptr<Wait>& wait) { wait->over = true; }

void CollectiveWatch::verdict(const Wait& wait) {
  std::exception_ptr verdict;
  {
    std::lock_guard<std::mutex> lock(const_cast<std::mutex&>(wait.mutex));
    verdict = wait.verdict;
  }
  if (verdict) std::rethrow_exception(verdict);
}

// ---- posting threads ----

namespace {

// The watchdogs a thread has posted to, so that it leaves their count when it ends.
struct PosterOf {
  struct Entry {
    const void* dog;  // which watchdog, compared before its registry is locked
    std::weak_ptr<void> alive;
    std::function<void()> leave;
  };
  std::vector<Entry> watches;
  bool knows(const void* dog) const {
    return std::any_of(watches.begin(), watches.end(), [&](const Entry& e) { return e.dog == dog && !e.alive.expired(); });
  }
  ~PosterOf() {
    for (auto& e : watches)
      if (e.alive.lock()) e.leave();
  }
};
thread_local PosterOf t_poster;

}  // namespace

void CollectiveWatch::posting() {
  if (t_poster.knows(dog_.get())) return;  // every post but a thread's first
  const auto id = std::this_thread::get_id();
  {
    std::lock_guard<std::mutex> lock(dog_->mutex);
    if (!dog_->posters.emplace(id, 0).second) return;
  }
  std::weak_ptr<Watchdog> dog = dog_;
  t_poster.watches.push_back({dog_.get(), dog_, [dog, id] {
    if (auto held = dog.lock()) {
      std::lock_guard<std::mutex> lock(held->mutex);
      held->posters.erase(id);
    }
  }});
}

CollectiveWatch::Blocked::Blocked(CollectiveWatch* watch) : watch_(watch) {
  if (!watch_) return;
  std::lock_guard<std::mutex> lock(watch_->dog_->mutex);
  const auto it = watch_->dog_->posters.find(std::this_thread::get_id());
  if (it != watch_->dog_->posters.end()) ++it->second;
}

CollectiveWatch::Blocked::~Blocked() {
  if (!watch_) return;
  std::lock_guard<std::mutex> lock(watch_->dog_->mutex);
  const auto it = watch_->dog_->posters.find(std::this_thread::get_id());
  if (it != watch_->dog_->posters.end() && it->second > 0) --it->second;
}

// ---- mismatches, shutdown, the end ----

void CollectiveWatch::mismatched(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mismatch_mutex_);
    if (!mismatch_) mismatch_ = error;
    has_mismatch_ = true;
  }
  {
    std::lock_guard<std::mutex> lock(dog_->mutex);
    if (!dog_->failure) dog_->failure = error;
  }
  dog_->fail_all(error);
}

std::exception_ptr CollectiveWatch::mismatch() const {
  if (!has_mismatch_) return nullptr;
  std::lock_guard<std::mutex> lock(mismatch_mutex_);
  return mismatch_;
}

void CollectiveWatch::shut_down(std::exception_ptr why, std::function<void()> abort) {
  shut_down_ = true;
  mismatched(why);
  if (abort) abort();
}

std::string CollectiveWatch::mismatch_line(const std::string& lane, uint64_t position, const Issuer& issuer,
                                           const std::string& mine) {
  const std::string prefix = "check/" + lane + "/" + std::to_string(position) + "/";
  std::vector<std::string> whats(static_cast<size_t>(world_size_));
  std::vector<Issuer> issuers(static_cast<size_t>(world_size_));
  whats[static_cast<size_t>(rank_)] = mine;
  issuers[static_cast<size_t>(rank_)] = issuer;
  const StoreClient& client = dog_->client;
  try {
    client.set(prefix + std::to_string(rank_), encode_issuer(issuer) + kField + mine);
    std::vector<std::string> keys;
    for (int r = 0; r < world_size_; ++r) keys.push_back(prefix + std::to_string(r));
    const std::vector<std::string> silent = client.wait(keys, kWordsWithin);
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_ || !client.check({keys[r]})) continue;
      const auto words = split_on(client.get(keys[r]), kField);
      if (words.size() != 2) continue;
      whats[r] = words[1];
      issuers[r] = decode_issuer(words[0]).value_or(Issuer(words[1]));
    }
    // Read, said so; and no rank goes on (to end its process, and with it
    // the store it may host: rank 0 under mpirun) before every rank that
    // left words has read them too.
    client.set(prefix + "read/" + std::to_string(rank_), "");
    std::vector<std::string> readers;
    for (const auto& key : keys)
      if (std::find(silent.begin(), silent.end(), key) == silent.end())
        readers.push_back(prefix + "read/" + key.substr(prefix.size()));
    client.wait(readers, kWordsWithin);
  } catch (const std::exception&) {
    // The store does not answer: the line says what this rank knows.
  }
  std::string line;
  std::vector<Whereabouts> said;
  for (int r = 0; r < world_size_; ++r) {
    if (whats[r].empty()) continue;
    line += (line.empty() ? "" : "; ") + dog_->names.rank(r) + " is in " + whats[r];
    said.push_back({issuers[r], false});
  }
  return dog_->names.line(line + ": " + advice_for(said));
}

std::exception_ptr CollectiveWatch::explain_loss(LaneState& lane, std::exception_ptr error) {
  bool checking;
  uint64_t position;
  Issuer issuer;
  std::string what;
  lost_peer_ = true;
  {
    std::lock_guard<std::mutex> lock(lane.mutex);
    checking = lane.checking;  // past the check, every rank reached this collective
    position = lane.passed;
    issuer = lane.issuer;
    what = lane.what;
  }
  try {
    if (auto found = dog_->deadlock_found(true)) return found;
    if (!checking) return error;
    if (auto mismatch = dog_->ended_before(lane.name, position, issuer, what, dog_->read_ended())) return mismatch;
  } catch (const std::exception&) {
    // The store is gone with the peer: the loss is all there is to say.
  }
  return error;
}

void CollectiveWatch::ended(bool cleanly) {
  try {
    if (dog_->counted_blocked.exchange(false)) dog_->client.add(kBlocked, -1);
    dog_->client.set(kEnded + "/" + std::to_string(rank_),
                     (cleanly ? "clean" : lost_peer_ ? "echo" : "error") + std::string(1, kBeatEnd) + dog_->status());
    dog_->client.add(kEnded, 1);
  } catch (const std::exception&) {
    // The store is gone: so is the job; nobody waits to be told.
  }
}

}  // namespace mnist_ddp
