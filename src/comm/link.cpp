// The Link's transfers (collectives.hpp): the group's collectives, shared
// memory and the ring, each watched by the group's watchdog.
#include "comm/collectives.hpp"

#include <deque>
#include <sstream>

#include "comm/shared_memory.hpp"

namespace mnist_ddp {

// Note on the link. Without shared memory, a 16-bit float tensor on the CPU
// (float16 of 64 Ki elements or more; bfloat16 always, which Gloo may not
// add) goes round a ring of point-to-point transfers that adds in float32:
// Gloo's own allreduce adds float16 one element at a time, which made the
// fp16 hook slower than sending float32. The ring sends pieces of
// kLinkPieceBytes, kLinkPiecesInFlight at a time, not a whole chunk per
// exchange (docs/performance.md, "The link"). Everything else, float32
// included, goes to Gloo's allreduce, asynchronously.

Link::Link(GroupPtr group, torch::Device device, const Backend& backend, std::unique_ptr<SharedMemoryReducer> shared,
           std::shared_ptr<CollectiveWatch> watch, std::shared_ptr<LaneState> lane)
    : group_(std::move(group)),
      device_(device),
      backend_(backend),
      shared_(std::move(shared)),
      watch_(std::move(watch)),
      lane_(lane ? std::move(lane) : std::make_shared<LaneState>("bulk")) {}

Link::~Link() = default;

void Link::issue(const char* kind, const torch::Tensor& tensor) {
  if (!probe) return;
  std::ostringstream s;
  s << kind;
  if (tensor.defined()) s << " " << tensor.scalar_type() << " " << tensor.sizes();
  probe->issued(s.str());
}

std::exception_ptr Link::explained(std::exception_ptr error) const {
  if (!watch_) return error;
  if (auto mismatch = watch_->mismatch()) return mismatch;
  return watch_->explain_loss(*lane_, error);
}

namespace {

// The lane marked as waiting (and, `checking`, in its check) while it lives.
class LaneWaits {
 public:
  LaneWaits(LaneState& lane, bool checking) : lane_(lane) { set(true, checking); }
  ~LaneWaits() { set(false, false); }
  LaneWaits(const LaneWaits&) = delete;
  LaneWaits& operator=(const LaneWaits&) = delete;

 private:
  void set(bool waiting, bool checking) {
    std::lock_guard<std::mutex> lock(lane_.mutex);
    lane_.waiting = waiting;
    lane_.checking = checking;
  }
  LaneState& lane_;
};

}  // namespace

FuturePtr Link::watched(const port::WorkPtr& work, bool checking) {
  if (!watch_) return work->getFuture();
  using Ends = CollectiveWatch::Ends;
  if (backend_.on_device) {  // NCCL completes on the device: polled; a verdict aborts its communicator
    GroupPtr group = group_;
    const Backend* backend = &backend_;
    return watch_->watch(lane_, work, Ends::poll, checking, [group, backend] { backend->abort(*group); });
  }
  return watch_->watch(lane_, work, Ends::future, checking);
}

void Link::finish(const port::WorkPtr& work, bool whole) {
  if (backend_.on_device) {  // the host does not wait for NCCL: the watchdog polls it
    watched(work, false);
    work->wait();
    return;
  }
  LaneWaits waits(*lane_, false);
  if (whole) {  // a send or a receive: waited on itself, aborted on a verdict
    std::shared_ptr<CollectiveWatch::Wait> wait = watch_ ? watch_->begin_wait(lane_, false, work) : nullptr;
    try {
      work->wait();
    } catch (...) {
      if (wait) CollectiveWatch::verdict(*wait);
      std::rethrow_exception(explained(std::current_exception()));
    }
    if (wait) watch_->end_wait(wait);
    return;
  }
  const FuturePtr done = watched(work, false);
  done->wait();
  if (done->hasError()) std::rethrow_exception(explained(done->exception_ptr()));
}

FuturePtr Link::allreduce_sum(torch::Tensor tensor) {
  issue("allreduce", tensor);
  if (through_shared_memory(tensor)) {
    torch::Tensor dense = tensor.contiguous();
    in_shared_memory(false, [&](const std::function<void()>& stalled) { shared_->allreduce_sum(dense, stalled); });
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
  return watched(group_->allreduce(tensors), false);
}

// Each rank sends 2 (W - 1) / W of the tensor, as Gloo's ring does.
void Link::ring_allreduce_sum(torch::Tensor& tensor) {
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

// `tensor` as the backend can move it: bfloat16 as the float16 of its bytes
// where the backend does not know bfloat16 (a copy moves bytes alike).
torch::Tensor Link::movable(const torch::Tensor& tensor) const {
  if (!backend_.bfloat16 && tensor.scalar_type() == torch::kBFloat16) return tensor.view(torch::kHalf);
  return tensor;
}

void Link::broadcast(torch::Tensor& tensor, int root) {
  issue("broadcast", tensor);
  if (through_shared_memory(tensor)) {
    torch::Tensor dense = tensor.contiguous();
    in_shared_memory(false, [&](const std::function<void()>& stalled) { shared_->broadcast(dense, root, stalled); });
    if (!dense.is_same(tensor)) tensor.copy_(dense);
    return;
  }
  std::vector<at::Tensor> tensors{movable(tensor)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  finish(group_->broadcast(tensors, opts));
}

std::vector<torch::Tensor> Link::gather_to_rank0(const torch::Tensor& tensor) {
  std::vector<at::Tensor> input{movable(tensor.to(staging()).contiguous())};
  issue("gather", input[0]);
  if (tensor.numel() == 0)  // Gloo divides by the size of what it gathers: nothing to move, nothing sent
    return rank() == 0 ? std::vector<torch::Tensor>(world_size(), tensor.cpu()) : std::vector<torch::Tensor>();
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

torch::Tensor Link::allgather(const torch::Tensor& tensor) {
  std::vector<at::Tensor> input{movable(tensor.contiguous())};
  issue("allgather", input[0]);
  if (tensor.numel() == 0) {  // Gloo divides by the size of what it gathers (SIGFPE): nothing to move
    std::vector<int64_t> shape{world_size()};
    for (const auto d : tensor.sizes()) shape.push_back(d);
    return torch::empty(shape, tensor.options());
  }
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < world_size(); ++r) output[0].push_back(torch::empty_like(input[0]));
  finish(group_->allgather(output, input));
  return torch::stack(output[0]).view(tensor.scalar_type());
}

void Link::reduce_scatter_sum(const torch::Tensor& output, const torch::Tensor& input) {
  if (backend_.reduce_scatter && !through_shared_memory(input)) {
    torch::Tensor in = input.contiguous(), out = output.contiguous();
    issue("reduce_scatter", in);
    finish(group_->_reduce_scatter_base(out, in));
    if (!out.is_same(output)) output.copy_(out);
    return;
  }
  torch::Tensor sum = input.reshape(-1).clone();
  allreduce_sum(sum)->waitAndThrow();
  output.copy_(sum.slice(0, rank() * output.numel(), (rank() + 1) * output.numel()).view_as(output));
}

void Link::exchange(const torch::Tensor& out, int to, torch::Tensor& in, int from, int64_t piece, int depth) {
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

void Link::barrier() {
  issue("barrier", torch::Tensor());
  if (shared_) {
    in_shared_memory(false, [&](const std::function<void()>& stalled) { shared_->barrier(stalled); });
    return;
  }
  finish(group_->barrier());
}

void Link::sum_check(torch::Tensor& sums, const GroupPtr& over) {
  LaneWaits waits(*lane_, true);
  if (!shared_) {
    std::vector<at::Tensor> tensors{sums};
    const port::WorkPtr work = over->allreduce(tensors);
    const FuturePtr done = watch_ ? watch_->watch(lane_, work, CollectiveWatch::Ends::future, true) : work->getFuture();
    done->wait();
    if (done->hasError()) std::rethrow_exception(explained(done->exception_ptr()));
    return;
  }
  in_shared_memory(true, [&](const std::function<void()>& stalled) { shared_->allreduce_sum(sums, stalled); });
}

bool Link::through_shared_memory(const torch::Tensor& tensor) const {
  return shared_ && tensor.is_cpu() && !tensor.is_sparse();
}

void Link::in_shared_memory(bool checking, const std::function<void(const std::function<void()>&)>& collective) {
  std::shared_ptr<CollectiveWatch::Wait> wait = watch_ ? watch_->begin_wait(lane_, checking) : nullptr;
  LaneWaits waits(*lane_, checking);
  try {
    collective([&] {
      if (wait) CollectiveWatch::verdict(*wait);
    });
  } catch (const PeerLost&) {
    std::rethrow_exception(explained(std::current_exception()));
  }
  if (wait) watch_->end_wait(wait);
}

FuturePtr Link::sum_check_async(torch::Tensor& sums, const GroupPtr& over) {
  std::vector<at::Tensor> tensors{sums};
  const port::WorkPtr work = over->allreduce(tensors);
  return watch_ ? watch_->watch(lane_, work, CollectiveWatch::Ends::future, true) : work->getFuture();
}

}  // namespace mnist_ddp
