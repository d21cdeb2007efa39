#include "comm/collectives.hpp"

#include <deque>
#include <sstream>

#include "comm/runtime.hpp"
#include "comm/shared_memory.hpp"

namespace mnist_ddp {

FuturePtr completed_future(const torch::Tensor& tensor) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  future->markCompleted(c10::IValue(tensor));
  return future;
}

Channel::Channel(GroupPtr group, torch::Device device, const Backend& backend, Check check,
                 std::unique_ptr<SharedMemoryReducer> shared, GroupPtr check_group, std::shared_ptr<CollectiveWatch> watch,
                 const std::string& lane)
    : group_(std::move(group)),
      device_(device),
      backend_(backend),
      check_(check),
      shared_(std::move(shared)),
      check_group_(check_group ? std::move(check_group) : group_),
      watch_(std::move(watch)),
      lane_(watch_ ? watch_->lane(lane) : std::make_shared<LaneState>(lane)),
      inline_(check == Check::before ? kInline : 0),
      active_(group_->getSize()) {}

Channel::~Channel() = default;

FuturePtr Channel::allreduce_sum(torch::Tensor tensor) {
  const bool small_float = tensor.numel() <= inline_ && tensor.is_cpu() && !tensor.is_sparse() &&
                           (tensor.scalar_type() == torch::kFloat || tensor.scalar_type() == torch::kDouble);
  if (small_float && world_size() > 1 && !follows_checked()) {
    issue("allreduce", tensor);
    check(Op::allreduce, tensor, 0, &tensor);
    return completed_future(tensor);
  }
  check(Op::allreduce, tensor, 0);
  return sum_unchecked(std::move(tensor));
}

void Channel::await(const port::WorkPtr& work, bool whole) {
  CollectiveWatch::Wait wait;
  while (!whole) {
    try {
      work->wait(std::chrono::milliseconds(100));
      return;
    } catch (...) {
      // The slice ran out, or the work failed (or completed just after the
      // slice ran out): a completed work's plain wait says which.
      if (work->isCompleted()) break;
    }
    if (watch_) watch_->stalled(*lane_, wait);
  }
  try {
    work->wait();
  } catch (...) {
    explained(std::current_exception());
  }
}

void Channel::explained(std::exception_ptr error) {
  if (watch_) {
    if (auto mismatch = watch_->mismatch()) std::rethrow_exception(mismatch);
    error = watch_->explain_loss(*lane_, error);
  }
  std::rethrow_exception(error);
}

void Channel::finish(const port::WorkPtr& work, bool whole) {
  if (backend_.on_device) {  // NCCL's wait in slices would abort its communicator
    work->wait();
    return;
  }
  struct Waiting {
    LaneState& lane;
    explicit Waiting(LaneState& l) : lane(l) { set(true); }
    ~Waiting() { set(false); }
    void set(bool on) {
      std::lock_guard<std::mutex> lock(lane.mutex);
      lane.waiting = on;
    }
  } waiting(*lane_);
  await(work, whole);
}

FuturePtr Channel::sum_unchecked(torch::Tensor tensor) {
  issue("allreduce", tensor);
  if (shared_ && tensor.is_cpu() && !tensor.is_sparse()) {
    torch::Tensor dense = tensor.contiguous();
    shared_->allreduce_sum(dense);
    if (!dense.is_same(tensor)) tensor.copy_(dense);
    return completed_future(tensor);
  }
  const bool half = tensor.scalar_type() == torch::kHalf, bfloat = tensor.scalar_type() == torch::kBFloat16;
  constexpr int64_t kRingFrom = 1 << 16;  // float16 elements
  if (backend_.slow_16bit_sums && world_size() > 1 && !tensor.is_sparse() &&
      ((half && tensor.numel() >= kRingFrom) || bfloat)) {
    if (tensor.is_cpu()) {
      ring_allreduce_sum(tensor);
    } else {  // ranks sharing a GPU over Gloo
      torch::Tensor cpu = tensor.cpu();
      ring_allreduce_sum(cpu);
      tensor.copy_(cpu);
    }
    return completed_future(tensor);
  }
  std::vector<at::Tensor> tensors{std::move(tensor)};
  return group_->allreduce(tensors)->getFuture();
}

// Each rank sends 2 (W - 1) / W of the tensor, as Gloo's ring does.
void Channel::ring_allreduce_sum(torch::Tensor& tensor) {
  const int world = world_size(), me = rank();
  const int next = (me + 1) % world, prev = (me + world - 1) % world;
  const int64_t n = tensor.numel(), chunk = (n + world - 1) / world;
  auto padded = torch::zeros({chunk * world}, tensor.options());
  padded.slice(0, 0, n).copy_(tensor.reshape(-1));
  auto chunks = padded.view({world, chunk});
  auto incoming = torch::empty({chunk}, tensor.options());
  const int64_t piece = kLinkPieceBytes / static_cast<int64_t>(tensor.element_size());
  for (int s = 0; s < world - 1; ++s) {  // chunk (me - s - 1) collects every rank's part
    const int64_t out = (me - s + world) % world, in = (me - s - 1 + world) % world;
    exchange(chunks[out], next, incoming, prev, piece, kLinkPiecesInFlight);
    chunks[in].copy_(chunks[in].to(torch::kFloat32).add_(incoming.to(torch::kFloat32)));
  }
  for (int s = 0; s < world - 1; ++s) {  // pass the finished chunks round
    const int64_t out = (me + 1 - s + world) % world, in = (me - s + world) % world;
    torch::Tensor finished = chunks[in];
    exchange(chunks[out], next, finished, prev, piece, kLinkPiecesInFlight);
  }
  tensor.copy_(padded.slice(0, 0, n).view_as(tensor));
}

void Channel::broadcast(torch::Tensor& tensor, int root) {
  broadcast_unchecked(tensor, check(Op::broadcast, tensor, root).root);
}

// `tensor` as the backend can move it: bfloat16 as the float16 of its bytes
// where the backend does not know bfloat16 (a copy moves bytes alike).
torch::Tensor Channel::movable(const torch::Tensor& tensor) const {
  if (!backend_.bfloat16 && tensor.scalar_type() == torch::kBFloat16) return tensor.view(torch::kHalf);
  return tensor;
}

void Channel::broadcast_unchecked(torch::Tensor& tensor, int root) {
  issue("broadcast", tensor);
  std::vector<at::Tensor> tensors{movable(tensor)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  finish(group_->broadcast(tensors, opts));
}

std::vector<torch::Tensor> Channel::gather_to_rank0(const torch::Tensor& tensor) {
  check(Op::gather, tensor, 0);
  return gather_unchecked(tensor);
}

std::vector<torch::Tensor> Channel::gather_unchecked(const torch::Tensor& tensor) {
  std::vector<at::Tensor> input{movable(tensor.to(staging()).contiguous())};
  issue("gather", input[0]);
  std::vector<std::vector<at::Tensor>> output;
  if (rank() == 0) {
    output.emplace_back();
    for (int r = 0; r < world_size(); ++r) output[0].push_back(torch::empty_like(input[0]));
  }
  c10d::GatherOptions opts;
  opts.rootRank = 0;
  finish(group_->gather(output, input, opts));
  std::vector<torch::Tensor> out;
  if (!output.empty())
    for (auto& t : output[0]) out.push_back(t.cpu().view(tensor.scalar_type()));
  return out;
}

torch::Tensor Channel::allgather(const torch::Tensor& tensor) {
  check(Op::allgather, tensor, 0);
  return allgather_unchecked(tensor);
}

torch::Tensor Channel::allgather_unchecked(const torch::Tensor& tensor) {
  std::vector<at::Tensor> input{movable(tensor.contiguous())};
  issue("allgather", input[0]);
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < world_size(); ++r) output[0].push_back(torch::empty_like(input[0]));
  finish(group_->allgather(output, input));
  return torch::stack(output[0]).view(tensor.scalar_type());
}

void Channel::exchange(const torch::Tensor& out, int to, torch::Tensor& in, int from, int64_t piece, int depth) {
  TORCH_CHECK(piece > 0 && depth > 0 && in.numel() == out.numel(), "exchange: bad pieces or sizes");
  issue("exchange", out);
  std::deque<std::pair<port::WorkPtr, port::WorkPtr>> in_flight;  // sent, received
  auto finish_oldest = [&] {
    finish(in_flight.front().second, true);
    finish(in_flight.front().first, true);
    in_flight.pop_front();
  };
  for (int64_t at = 0; at < out.numel(); at += piece) {
    if (static_cast<int>(in_flight.size()) == depth) finish_oldest();
    const int64_t end = std::min(out.numel(), at + piece);
    std::vector<at::Tensor> send{out.slice(0, at, end)}, recv{in.slice(0, at, end)};
    const int tag = tag_;
    tag_ = (tag_ + 1) % (1 << 30);
    auto sent = group_->send(send, to, tag);
    in_flight.emplace_back(std::move(sent), group_->recv(recv, from, tag));
  }
  while (!in_flight.empty()) finish_oldest();
}

void Channel::barrier() {
  issue("barrier", torch::Tensor());
  // Checked before its transfer, the check is itself the barrier.
  if (world_size() > 1 && check_ == Check::before) return void(check(Op::barrier, torch::Tensor(), 0));
  check(Op::barrier, torch::Tensor(), 0);
  finish(group_->barrier());
}

CollectiveStream::CollectiveStream(GroupPtr group, torch::Device device, const Backend& backend, Check check,
                                   std::unique_ptr<SharedMemoryReducer> shared, GroupPtr check_group,
                                   std::shared_ptr<CollectiveWatch> watch, const std::string& lane)
    : rank_(group->getRank()),
      world_size_(group->getSize()),
      device_(device),
      backend_(backend),
      group_(group),
      watch_(watch),
      channel_(std::move(group), device, backend, check, std::move(shared), std::move(check_group), std::move(watch),
               lane) {
  thread_ = std::thread([this] { loop(); });
}

CollectiveStream::~CollectiveStream() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
  if (!error_) backend_.shut_down(*group_);
}

CollectiveStream::Ticket CollectiveStream::post(Task task, std::string issuer, Skipped skipped) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (const auto probe = probe_) {
    lock.unlock();
    probe->posting();
    lock.lock();
  }
  const Ticket ticket = posted_++;
  if (abandoned_) {  // never run: the loop may have ended
    const auto why = abandoned_;
    lock.unlock();
    if (skipped) skipped(why);
    return ticket;
  }
  queue_.push_back(Queued{ticket, std::move(task), std::move(issuer), std::move(skipped)});
  cv_.notify_all();
  return ticket;
}

void CollectiveStream::wait(Ticket ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!cv_.wait_for(lock, std::chrono::milliseconds(200), [&] { return finished_ > ticket || abandoned_; }))
    if (watch_)
      if (auto mismatch = watch_->mismatch()) {
        // This lane's own tasks may never finish: none queued starts now
        // (its caller, gone, may own what it would touch).
        if (!error_) {
          error_ = mismatch;
          failed_ = finished_;
        }
        std::rethrow_exception(mismatch);
      }
  if (abandoned_ && finished_ <= ticket) std::rethrow_exception(abandoned_);
  if (error_ && ticket >= failed_) std::rethrow_exception(error_);
}

bool CollectiveStream::finished(Ticket ticket) {
  std::lock_guard<std::mutex> lock(mutex_);
  return finished_ > ticket;
}

void CollectiveStream::abandon(std::exception_ptr why) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    abandoned_ = why;
    if (!error_) {
      error_ = why;
      failed_ = posted_;
    }
    stopping_ = true;
  }
  cv_.notify_all();
}

void CollectiveStream::run(const Task& task, std::string issuer) { wait(post(task, std::move(issuer))); }

std::exception_ptr CollectiveStream::explained(std::exception_ptr error) {
  try {
    channel_.explained(std::move(error));
  } catch (...) {
    return std::current_exception();
  }
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

}  // namespace

void CollectiveStream::loop() {
  use_device(device_);
  for (;;) {
    Queued next;
    bool skip = false;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      next = std::move(queue_.front());
      queue_.pop_front();
      skip = error_ != nullptr;
    }
    if (skip && next.skipped) {  // outside the lock: the future's callbacks may post
      std::exception_ptr why;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        why = error_;
      }
      next.skipped(why);
    }
    if (!skip) {
      if (channel_.probe) channel_.probe->running();
      channel_.set_issuer(next.issuer);
      try {
        next.task(channel_);
      } catch (...) {
        const std::exception_ptr error = in_our_words(std::current_exception(), next.issuer);
        std::lock_guard<std::mutex> lock(mutex_);
        error_ = error;
        failed_ = next.ticket;
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      finished_ = next.ticket + 1;
    }
    cv_.notify_all();
  }
}

std::pair<CollectiveStream::Ticket, FuturePtr> CollectiveStream::post_for(std::function<c10::IValue(Channel&)> task,
                                                                         std::string issuer) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  const std::string who = issuer;
  const Ticket ticket = post(
      [task = std::move(task), future, who](Channel& c) {
        try {
          future->markCompleted(task(c));
        } catch (...) {
          future->setError(in_our_words(std::current_exception(), who));
          throw;
        }
      },
      std::move(issuer), [future](std::exception_ptr why) { future->setErrorIfNeeded(why); });
  return {ticket, future};
}

// The conveniences' tasks hold what they touch (tensors share their
// storage; results go through a shared cell): a wait may throw while its
// task still runs (another lane's mismatch), and the caller's frame is gone.
void CollectiveStream::allreduce_sum(torch::Tensor& tensor, std::string issuer) {
  run([tensor](Channel& c) { c.allreduce_sum(tensor)->waitAndThrow(); }, std::move(issuer));
}

void CollectiveStream::broadcast(torch::Tensor& tensor, int root, std::string issuer) {
  run([tensor, root](Channel& c) mutable { c.broadcast(tensor, root); }, std::move(issuer));
}

std::vector<torch::Tensor> CollectiveStream::gather_to_rank0(const torch::Tensor& tensor, std::string issuer) {
  auto out = std::make_shared<std::vector<torch::Tensor>>();
  run([out, tensor](Channel& c) { *out = c.gather_to_rank0(tensor); }, std::move(issuer));
  return std::move(*out);
}

torch::Tensor CollectiveStream::allgather(const torch::Tensor& tensor, std::string issuer) {
  auto out = std::make_shared<torch::Tensor>();
  run([out, tensor](Channel& c) { *out = c.allgather(tensor); }, std::move(issuer));
  return *out;
}

std::string CollectiveStream::disagreement(std::vector<std::pair<std::string, std::string>> items, std::string subject,
                                           std::string advice, std::string issuer) {
  auto out = std::make_shared<std::string>();
  run([out, items = std::move(items), subject = std::move(subject), advice = std::move(advice)](
          Channel& c) { *out = c.disagreement(items, subject, advice); },
      std::move(issuer));
  return *out;
}

void CollectiveStream::broadcast_bytes(std::vector<char>& bytes, std::string issuer) {
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

void CollectiveStream::barrier(std::string issuer) {
  run([](Channel& c) { c.barrier(); }, std::move(issuer));
}

void CollectiveStream::watch(std::shared_ptr<StreamProbe> probe) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    probe_ = probe;
  }
  run([probe](Channel& c) { c.probe = probe; });
}

}  // namespace mnist_ddp
