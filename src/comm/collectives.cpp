// The CollectiveStream (collectives.hpp): its thread, its queue and its
// waits; the Channel's check is in check.cpp, the Link's transfers in
// link.cpp.
#include "comm/collectives.hpp"

#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <sstream>

#include "comm/runtime.hpp"
#include "comm/shared_memory.hpp"

namespace mnist_ddp {

FuturePtr completed_future(const torch::Tensor& tensor) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  future->markCompleted(c10::IValue(tensor));
  return future;
}

struct CollectiveStream::Core {
  Core(Channel c, const Backend& b, GroupPtr g) : channel(std::move(c)), backend(b), group(std::move(g)) {}
  Channel channel;
  const Backend& backend;
  GroupPtr group;
  struct Queued {
    Ticket ticket;
    Task task;
    Issuer issuer;
    Skipped skipped;       // told why, where the task is not run
    bool program = false;  // a Work of the program's (post_for)
  };
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<Queued> queue;
  Ticket posted = 0;    // tickets [0, posted) were handed out
  Ticket finished = 0;  // tasks [0, finished) have run (or were skipped)
  std::exception_ptr error;
  Ticket failed = 0;    // the first failed task, when error is set
  bool error_seen = false;  // a wait has thrown it
  bool error_program = false;  // it was a Work's, the program's to see
  std::map<Ticket, bool> refused_program;  // the refusals of Works, by task
  std::map<Ticket, std::exception_ptr> refused;  // RefusedEverywhere, by task: only its wait throws it
  bool stopping = false;
  std::exception_ptr abandoned;  // abandon()'s reason, for the tasks posted before it
  std::exception_ptr refused_later;  // abandon()'s word for the tasks posted after it
  Ticket abandoned_at = 0;       // the first ticket posted after it
  std::shared_ptr<StreamProbe> probe;  // the posting threads' view, under mutex
};

CollectiveStream::CollectiveStream(Channel channel)
    : rank_(channel.rank()),
      world_size_(channel.world_size()),
      device_(channel.device()),
      shares_memory_(channel.shares_memory()),
      watch_(channel.link().watch()),
      lane_(channel.link().lane()) {
  const Backend& backend = channel.link().backend();
  GroupPtr group = channel.link().group();
  core_ = std::make_shared<Core>(std::move(channel), backend, std::move(group));
  thread_ = std::thread([core = core_] { loop(core); });
}

CollectiveStream::~CollectiveStream() {
  {
    std::lock_guard<std::mutex> lock(core_->mutex);
    core_->stopping = true;
  }
  core_->cv.notify_all();
  if (std::this_thread::get_id() == thread_.get_id()) {
    thread_.detach();  // a task held the last handle: the thread ends once this task returns
    return;
  }
  thread_.join();
  if (!core_->error && !core_->abandoned) core_->backend.shut_down(*core_->group);
}

CollectiveStream::Ticket CollectiveStream::post(Task task, Issuer issuer, Skipped skipped, bool program) {
  if (watch_) watch_->posting();
  std::unique_lock<std::mutex> lock(core_->mutex);
  if (const auto probe = core_->probe) {
    lock.unlock();
    probe->posting();
    lock.lock();
  }
  const Ticket ticket = core_->posted++;
  if (core_->abandoned) {  // never run: the loop may have ended
    const auto why = core_->refused_later;
    lock.unlock();
    if (skipped) skipped(why);
    return ticket;
  }
  core_->queue.push_back(Core::Queued{ticket, std::move(task), std::move(issuer), std::move(skipped), program});
  core_->cv.notify_all();
  return ticket;
}

void CollectiveStream::wait(Ticket ticket) {
  Core& core = *core_;
  if (std::this_thread::get_id() == thread_.get_id())
    throw UsageError("a collective was waited for on the thread that issues them (in a Work's callback, or a "
                     "communication hook, calling the group's collectives): it would wait for itself; wait in the "
                     "program's own thread, or use the hook's Wire");
  CollectiveWatch::Blocked blocked(watch_.get());
  std::unique_lock<std::mutex> lock(core.mutex);
  while (!core.cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return core.finished > ticket || core.abandoned; }))
    if (watch_)
      if (auto mismatch = watch_->mismatch()) {
        // This lane's own tasks may never finish: none queued starts now
        // (its poster, gone, may have stopped caring for its results).
        if (!core.error) {
          core.error = mismatch;
          core.failed = core.finished;
        }
        core.error_seen = true;
        std::rethrow_exception(mismatch);
      }
  if (core.abandoned && core.finished <= ticket)
    std::rethrow_exception(ticket >= core.abandoned_at ? core.refused_later : core.abandoned);
  const auto refused = core.refused.find(ticket);
  if (refused != core.refused.end()) {
    const auto error = refused->second;
    core.refused.erase(refused);
    core.refused_program.erase(ticket);
    std::rethrow_exception(error);
  }
  if (core.error && ticket >= core.failed) {
    core.error_seen = true;
    std::rethrow_exception(core.error);
  }
}

bool CollectiveStream::wait_for(Ticket ticket, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(core_->mutex);
  return core_->cv.wait_for(lock, timeout, [&] { return core_->finished > ticket || core_->abandoned; });
}

bool CollectiveStream::finished(Ticket ticket) {
  std::lock_guard<std::mutex> lock(core_->mutex);
  return core_->finished > ticket;
}

void CollectiveStream::abandon(std::exception_ptr why, std::exception_ptr later) {
  {
    std::lock_guard<std::mutex> lock(core_->mutex);
    core_->abandoned = why;
    core_->refused_later = later ? later : why;
    core_->abandoned_at = core_->posted;
    if (!core_->error) {
      core_->error = why;
      core_->failed = core_->posted;
      core_->error_seen = true;
    }
    core_->stopping = true;
  }
  core_->cv.notify_all();
}

void CollectiveStream::drain() {
  if (std::this_thread::get_id() == thread_.get_id()) return;
  std::unique_lock<std::mutex> lock(core_->mutex);
  core_->cv.wait(lock, [&] { return core_->finished >= core_->posted || core_->abandoned; });
}

void CollectiveStream::abort_backend() { core_->backend.abort(*core_->group); }

std::exception_ptr CollectiveStream::unseen_failure() {
  std::lock_guard<std::mutex> lock(core_->mutex);
  if (core_->error && !core_->error_seen && core_->error_program) return core_->error;
  for (const auto& [ticket, program] : core_->refused_program)
    if (program) return core_->refused.at(ticket);
  return nullptr;
}

void CollectiveStream::run(const Task& task, Issuer issuer) { wait(post(task, std::move(issuer))); }

std::exception_ptr CollectiveStream::explained(std::exception_ptr error) {
  return core_->channel.link().explained(std::move(error));
}

namespace {

// What a task threw, as an mnist_ddp::Error: a backend's exception (Gloo's,
// c10's) becomes a CollectiveFailed that says, in our words first, who was
// issuing what.
std::exception_ptr in_our_words(std::exception_ptr thrown, const std::string& issuer) {
  try {
    std::rethrow_exception(thrown);
  } catch (const Error&) {
    return thrown;
  } catch (const std::exception& e) {
    return std::make_exception_ptr(CollectiveFailed(issuer + ": a collective failed: " + error_line(e)));
  } catch (...) {
    return std::make_exception_ptr(CollectiveFailed(issuer + ": a collective failed"));
  }
}

// The lane marked as running a task while it lives.
class LaneBusy {
 public:
  explicit LaneBusy(LaneState& lane) : lane_(lane) { set(true); }
  ~LaneBusy() { set(false); }
  LaneBusy(const LaneBusy&) = delete;
  LaneBusy& operator=(const LaneBusy&) = delete;

 private:
  void set(bool busy) {
    std::lock_guard<std::mutex> lock(lane_.mutex);
    lane_.busy = busy;
  }
  LaneState& lane_;
};

}  // namespace

// Runs one task, recording how it ended: a failure stops the stream, a
// RefusedEverywhere only its own wait.
void run_task(CollectiveStream::Task& task, const Issuer& issuer, Channel& channel, std::exception_ptr& failed,
              bool& refused) {
  if (auto probe = channel.link().probe) probe->running();
  channel.starting_task();
  channel.set_issuer(issuer);
  LaneBusy busy(*channel.link().lane());
  try {
    task(channel);
  } catch (const RefusedEverywhere&) {
    failed = std::current_exception();
    refused = true;
  } catch (...) {
    failed = in_our_words(std::current_exception(), issuer.text);
  }
}

void CollectiveStream::loop(const std::shared_ptr<Core>& core) {
  use_device(core->channel.device());
  for (;;) {
    Core::Queued next;
    std::exception_ptr skip;
    {
      std::unique_lock<std::mutex> lock(core->mutex);
      core->cv.wait(lock, [&] { return core->stopping || !core->queue.empty(); });
      if (core->queue.empty() || core->abandoned) return;
      next = std::move(core->queue.front());
      core->queue.pop_front();
      skip = core->error;
    }
    std::exception_ptr failed;
    bool refused = false;
    if (skip) {
      if (next.skipped) next.skipped(skip);  // outside the lock: the future's callbacks may post
    } else {
      run_task(next.task, next.issuer, core->channel, failed, refused);
    }
    const Ticket ticket = next.ticket;
    const bool program = next.program;
    next = Core::Queued{};  // what the task held goes before it counts as finished
    {
      std::lock_guard<std::mutex> lock(core->mutex);
      if (failed && refused) {
        core->refused[ticket] = failed;
        core->refused_program[ticket] = program;
      } else if (failed && !core->error) {
        core->error = failed;
        core->failed = ticket;
        core->error_program = program;
      }
      core->finished = ticket + 1;
    }
    core->cv.notify_all();
  }
}

std::pair<CollectiveStream::Ticket, FuturePtr> CollectiveStream::post_for(std::function<c10::IValue(Channel&)> task,
                                                                         Issuer issuer) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  const std::string who = issuer.text;
  const Ticket ticket = post(
      [task = std::move(task), future, who](Channel& c) {
        c10::IValue value;
        try {
          value = task(c);
        } catch (...) {
          future->setError(in_our_words(std::current_exception(), who));
          throw;
        }
        future->markCompleted(std::move(value));  // its callbacks run here: one that waits on this stream is refused
      },
      std::move(issuer), [future](std::exception_ptr why) { future->setErrorIfNeeded(why); }, /*program=*/true);
  return {ticket, future};
}

// The conveniences' tasks hold what they touch (tensors share their
// storage; results go through a shared cell): a wait may throw while its
// task still runs (another lane's mismatch), and the caller's frame is gone.
void CollectiveStream::allreduce_sum(torch::Tensor& tensor, Issuer issuer) {
  run([tensor](Channel& c) { c.allreduce_sum(tensor)->waitAndThrow(); }, std::move(issuer));
}

void CollectiveStream::broadcast(torch::Tensor& tensor, int root, Issuer issuer) {
  run([tensor, root](Channel& c) mutable { c.broadcast(tensor, root); }, std::move(issuer));
}

std::vector<torch::Tensor> CollectiveStream::gather_to_rank0(const torch::Tensor& tensor, Issuer issuer) {
  auto out = std::make_shared<std::vector<torch::Tensor>>();
  run([out, tensor](Channel& c) { *out = c.gather_to_rank0(tensor); }, std::move(issuer));
  return std::move(*out);
}

torch::Tensor CollectiveStream::allgather(const torch::Tensor& tensor, Issuer issuer) {
  auto out = std::make_shared<torch::Tensor>();
  run([out, tensor](Channel& c) { *out = c.allgather(tensor); }, std::move(issuer));
  return *out;
}

std::string CollectiveStream::disagreement(std::vector<std::pair<std::string, std::string>> items, std::string subject,
                                           std::string advice, Issuer issuer) {
  auto out = std::make_shared<std::string>();
  run([out, items = std::move(items), subject = std::move(subject), advice = std::move(advice)](
          Channel& c) { *out = c.disagreement(items, subject, advice); },
      std::move(issuer));
  return *out;
}

void CollectiveStream::broadcast_bytes(std::vector<char>& bytes, Issuer issuer) {
  auto cell = std::make_shared<std::vector<char>>(bytes);
  run(
      [cell, rank = rank_](Channel& c) {
        auto& held = *cell;
        const torch::Device where = c.staging();
        auto size = torch::tensor({static_cast<int64_t>(held.size())}, torch::kInt64).to(where);
        c.broadcast(size, 0);
        const int64_t n = size.cpu().item<int64_t>();
        auto data = rank == 0 ? torch::from_blob(held.data(), {n}, torch::kUInt8).to(where, false, /*copy=*/true)
                              : torch::empty({n}, torch::TensorOptions(torch::kUInt8).device(where));
        c.broadcast(data, 0);
        if (rank != 0) {
          const auto cpu = data.cpu();
          held.assign(static_cast<const char*>(cpu.data_ptr()), static_cast<const char*>(cpu.data_ptr()) + n);
        }
      },
      std::move(issuer));
  bytes = std::move(*cell);
}

void CollectiveStream::barrier(Issuer issuer) {
  run([](Channel& c) { c.barrier(); }, std::move(issuer));
}

void CollectiveStream::watch(std::shared_ptr<StreamProbe> probe) {
  {
    std::lock_guard<std::mutex> lock(core_->mutex);
    core_->probe = probe;
  }
  run([probe](Channel& c) { c.link().probe = probe; });
}

}  // namespace mnist_ddp
