// The averaging of buckets in flight (averager.hpp).
#include "parallel/averager.hpp"

#include <chrono>
#include <optional>
#include <typeinfo>

#include "mnist_ddp/base/errors.hpp"
#include "parallel/advice.hpp"
#include "parallel/wires.hpp"

namespace mnist_ddp {

namespace {

// A hook of ours, exactly (not a program's subclass): the sizes of its
// collectives over a bucket follow from its options and the bucket, which
// every rank has agreed (Channel::DeterminedRun).
bool determined(const hooks::CommHook& hook) {
  const auto& type = typeid(hook);
  if (type == typeid(hooks::CompressWrapper)) return determined(*static_cast<const hooks::CompressWrapper&>(hook).inner());
  return type == typeid(hooks::AllreduceHook) || type == typeid(hooks::PowerSgdHook) ||
         type == typeid(hooks::BatchedPowerSgdHook);
}

}  // namespace

Averager::Averager(std::shared_ptr<CollectiveStream> stream, DdpNames names)
    : stream_(std::move(stream)), names_(std::move(names)), hook_(hooks::allreduce()) {}

CollectiveStream::Ticket Averager::post(const hooks::GradBucket& bucket) {
  const auto ticket = stream_->post(
      [self = shared_from_this(), bucket, round = round_.load()](Channel& channel) { self->communicate(bucket, round, channel); },
      names_.bucket(static_cast<int>(bucket.index())));
  std::lock_guard<std::mutex> lock(mutex_);
  posted_.push_back(ticket);
  return ticket;
}

CollectiveStream::Ticket Averager::post_count(const torch::Tensor& mine, std::shared_ptr<torch::Tensor> into) {
  const auto ticket = stream_->post(
      [mine, into](Channel& channel) {
        torch::Tensor sum = mine.to(channel.staging());
        channel.allreduce_sum(sum)->waitAndThrow();
        *into = sum.cpu();
      },
      names_.issuer(kUnusedCount, "DistributedDataParallel's count of the ranks that used each parameter"));
  std::lock_guard<std::mutex> lock(mutex_);
  posted_.push_back(ticket);
  return ticket;
}

// Every rank's first bucket of its first averaging backward: the hooks
// compared, so that a difference is named before their collectives differ.
void Averager::agree_on_hook(Channel& channel) {
  const Issuer issuer = channel.issuer();
  channel.set_issuer(names_.issuer(kHookAgreement, "register_comm_hook"));
  const std::string difference = channel.disagreement(
      {{"hook", hook_->describe()}}, "register_comm_hook",
      "every rank must register the same communication hook, with the same options");
  channel.set_issuer(issuer);
  if (!difference.empty()) throw UsageError(difference);
  hook_agreed_ = true;
}

// Note on checks of buckets. A hook of ours over a backward's buckets is
// checked once: the sizes of its collectives follow from the layout
// (compared when the DDP was built) and the hook (compared at the first
// backward), and a backward's buckets are posted one after another on the
// lane, nothing between them (a rank whose backward stopped half-way posts
// the rest first thing at its next forward: Iteration::left_open()). That
// one check is made as the backward begins (announce(): its first
// gradient), so that its round trip overlaps the backward's compute
// instead of delaying the first bucket; where the channel does not
// announce (Channel::announce), or anything comes between, it is the
// first collective of the first dense bucket. Where a rank has joined,
// every collective is checked. A rank whose backward throws after the
// announcement and issues something else on this lane before its next
// forward leaves its peers in their first bucket, unchecked, and itself in
// a check: on groups of their own these never meet on the wire, and the
// wait is reported, then named at the timeout. A check made at the forward
// would do that to every rank whose forward threw: it is not made.
void Averager::announce(const hooks::GradBucket& first) {
  if (!announcing_ || !determined(*hook_) || !first.buffer().defined()) return;  // no task a step for nothing
  const auto ticket = stream_->post(
      [self = shared_from_this(), first, round = round_.load()](Channel& channel) {
        if (!self->hook_agreed_) return;
        Channel::DeterminedRun run(channel, round);
        self->announcing_ = channel.announce(first.buffer());
      },
      names_.bucket(0));
  std::lock_guard<std::mutex> lock(mutex_);
  posted_.push_back(ticket);
}

void Averager::communicate(const hooks::GradBucket& bucket, uint64_t round, Channel& channel) {
  if (bucket.index() == 0 && !hook_agreed_) agree_on_hook(channel);
  FuturePtr result;
  if (bucket.buffer().defined()) {
    hooks::GroupWire wire(channel, wire_);
    std::optional<Channel::DeterminedRun> run;
    if (determined(*hook_)) run.emplace(channel, round, true);
    result = hook_->run(bucket, wire);
  } else {  // a sparse gradient, summed as one (the hook takes dense buckets)
    const torch::Tensor& param = bucket.parameters()[0];
    const torch::Tensor grad = param.grad().defined() ? param.grad() : torch::zeros_like(param).to_sparse();
    result = channel.allreduce_sum(grad.coalesce());
  }
  if (CollectiveWatch* watch = stream_->watchdog())  // a hook's future that never completes is named at the timeout
    result = watch->watch(stream_->lane(), result, channel.issuer(),
                          "the future " + hook_->name() + " returned for " + channel.issuer().text);
  std::lock_guard<std::mutex> lock(mutex_);
  in_flight_.push_back({bucket, std::move(result)});
}

// A failure in our words, as the stream says a task's: a backend's own
// exception becomes a CollectiveFailed naming the bucket.
std::exception_ptr Averager::first_error(std::exception_ptr error, const hooks::GradBucket& bucket) {
  error = stream_->explained(error);
  try {
    std::rethrow_exception(error);
  } catch (const Error&) {
    return error;
  } catch (const std::exception& e) {
    return std::make_exception_ptr(CollectiveFailed(names_.bucket(static_cast<int>(bucket.index())).text +
                                                    ": a collective failed: " + error_line(e)));
  }
}

void Averager::take(double scale, double divisor) {
  std::vector<CollectiveStream::Ticket> posted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    posted.swap(posted_);
  }
  next_round();
  const auto start = std::chrono::steady_clock::now();
  std::exception_ptr error;
  for (const auto ticket : posted) {
    try {
      stream_->wait(ticket);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  std::vector<InFlight> in_flight;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    in_flight.swap(in_flight_);
  }
  CollectiveWatch::Blocked blocked(stream_->watchdog());
  for (const auto& [bucket, result] : in_flight) {
    if (error) break;
    try {
      result->waitAndThrow();
      const torch::Tensor averaged = hooks::future_tensor(result);
      torch::NoGradGuard no_grad;
      if (!bucket.buffer().defined()) {  // sparse: the sum, averaged here
        torch::Tensor(bucket.parameters()[0]).mutable_grad() = averaged / divisor;
        continue;
      }
      if (!averaged.is_same(bucket.buffer())) bucket.buffer().copy_(averaged);
      if (scale != 1) bucket.buffer().mul_(scale);
    } catch (...) {
      error = first_error(std::current_exception(), bucket);
    }
  }
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (error) std::rethrow_exception(error);
}

}  // namespace mnist_ddp
