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

Channel::Channel(GroupPtr group, torch::Device device, const Backend& backend, std::unique_ptr<SharedMemoryReducer> shared)
    : group_(std::move(group)), device_(device), backend_(backend), shared_(std::move(shared)) {}

Channel::~Channel() = default;

void Channel::issue(const char* kind, const torch::Tensor& tensor) {
  if (!probe) return;
  std::ostringstream s;
  s << kind;
  if (tensor.defined()) s << " " << tensor.scalar_type() << " " << tensor.sizes();
  probe->issued(s.str());
}

FuturePtr Channel::allreduce_sum(torch::Tensor tensor) {
  issue("allreduce", tensor);
  if (shared_ && tensor.is_cpu()) {
    torch::Tensor dense = tensor.contiguous();
    shared_->allreduce_sum(dense);
    if (!dense.is_same(tensor)) tensor.copy_(dense);
    return completed_future(tensor);
  }
  const bool half = tensor.scalar_type() == torch::kHalf, bfloat = tensor.scalar_type() == torch::kBFloat16;
  constexpr int64_t kRingFrom = 1 << 16;  // float16 elements
  if (backend_.slow_16bit_sums && world_size() > 1 && ((half && tensor.numel() >= kRingFrom) || bfloat)) {
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
  issue("broadcast", tensor);
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  group_->broadcast(tensors, opts)->wait();
}

std::vector<torch::Tensor> Channel::gather_to_rank0(const torch::Tensor& tensor) {
  std::vector<at::Tensor> input{tensor.to(staging()).contiguous()};
  issue("gather", input[0]);
  std::vector<std::vector<at::Tensor>> output;
  if (rank() == 0) {
    output.emplace_back();
    for (int r = 0; r < world_size(); ++r) output[0].push_back(torch::empty_like(input[0]));
  }
  c10d::GatherOptions opts;
  opts.rootRank = 0;
  group_->gather(output, input, opts)->wait();
  std::vector<torch::Tensor> out;
  if (!output.empty())
    for (auto& t : output[0]) out.push_back(t.cpu());
  return out;
}

torch::Tensor Channel::allgather(const torch::Tensor& tensor) {
  std::vector<at::Tensor> input{tensor.contiguous()};
  issue("allgather", input[0]);
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < world_size(); ++r) output[0].push_back(torch::empty_like(input[0]));
  group_->allgather(output, input)->wait();
  return torch::stack(output[0]);
}

void Channel::exchange(const torch::Tensor& out, int to, torch::Tensor& in, int from, int64_t piece, int depth) {
  TORCH_CHECK(piece > 0 && depth > 0 && in.numel() == out.numel(), "exchange: bad pieces or sizes");
  issue("exchange", out);
  using WorkPtr = decltype(group_->send(std::declval<std::vector<at::Tensor>&>(), 0, 0));
  std::deque<std::pair<WorkPtr, WorkPtr>> in_flight;  // sent, received
  auto finish_oldest = [&] {
    in_flight.front().second->wait();
    in_flight.front().first->wait();
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
  group_->barrier()->wait();
}

CollectiveStream::CollectiveStream(GroupPtr group, torch::Device device, const Backend& backend,
                                   std::unique_ptr<SharedMemoryReducer> shared)
    : rank_(group->getRank()),
      world_size_(group->getSize()),
      device_(device),
      backend_(backend),
      group_(group),
      channel_(std::move(group), device, backend, std::move(shared)) {
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

CollectiveStream::Ticket CollectiveStream::post(Task task) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (const auto probe = probe_) {
    lock.unlock();
    probe->posting();
    lock.lock();
  }
  const Ticket ticket = posted_++;
  queue_.emplace_back(ticket, std::move(task));
  cv_.notify_all();
  return ticket;
}

void CollectiveStream::wait(Ticket ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return finished_ > ticket; });
  if (error_ && ticket >= failed_) std::rethrow_exception(error_);
}

void CollectiveStream::run(const Task& task) { wait(post(task)); }

void CollectiveStream::loop() {
  use_device(device_);
  for (;;) {
    std::pair<Ticket, Task> next;
    bool skip = false;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      next = std::move(queue_.front());
      queue_.pop_front();
      skip = error_ != nullptr;
    }
    if (!skip) {
      if (channel_.probe) channel_.probe->running();
      try {
        next.second(channel_);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        error_ = std::current_exception();
        failed_ = next.first;
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      finished_ = next.first + 1;
    }
    cv_.notify_all();
  }
}

void CollectiveStream::allreduce_sum(torch::Tensor& tensor) {
  run([&](Channel& c) { c.allreduce_sum(tensor)->waitAndThrow(); });
}

void CollectiveStream::broadcast(torch::Tensor& tensor, int root) {
  run([&](Channel& c) { c.broadcast(tensor, root); });
}

std::vector<torch::Tensor> CollectiveStream::gather_to_rank0(const torch::Tensor& tensor) {
  std::vector<torch::Tensor> out;
  run([&](Channel& c) { out = c.gather_to_rank0(tensor); });
  return out;
}

torch::Tensor CollectiveStream::allgather(const torch::Tensor& tensor) {
  torch::Tensor out;
  run([&](Channel& c) { out = c.allgather(tensor); });
  return out;
}

void CollectiveStream::broadcast_bytes(std::vector<char>& bytes) {
  run([&](Channel& c) {
    const torch::Device where = c.staging();
    auto size = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kInt64).to(where);
    c.broadcast(size, 0);
    const int64_t n = size.cpu().item<int64_t>();
    auto data = rank_ == 0 ? torch::from_blob(bytes.data(), {n}, torch::kUInt8).to(where, false, /*copy=*/true)
                           : torch::empty({n}, torch::TensorOptions(torch::kUInt8).device(where));
    c.broadcast(data, 0);
    if (rank_ != 0) {
      const auto cpu = data.cpu();
      bytes.assign(static_cast<const char*>(cpu.data_ptr()), static_cast<const char*>(cpu.data_ptr()) + n);
    }
  });
}

void CollectiveStream::barrier() {
  run([](Channel& c) { c.barrier(); });
}

void CollectiveStream::watch(std::shared_ptr<StreamProbe> probe) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    probe_ = probe;
  }
  run([probe](Channel& c) { c.probe = probe; });
}

}  // namespace mnist_ddp
