// The averaging of one DDP's buckets: runs the communication hook on each
// bucket as a task of the model's bulk stream, and takes the averages
// back. Not installed.
//
// Note on ownership. A bucket's task may run after the DDP that posted it
// is gone (a backward that threw, a shutdown(), a mismatch that unwound the
// program's scope): so it holds what it touches, the Averager (the hook,
// the futures in flight, the wire's counts) and the bucket (its buffer and
// views), and nothing of the Reducer's.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "mnist_ddp/parallel/comm_hooks.hpp"
#include "comm/collectives.hpp"

namespace mnist_ddp {

class Averager : public std::enable_shared_from_this<Averager> {
 public:
  // `names`: how its DDP names its collectives.
  Averager(std::shared_ptr<CollectiveStream> stream, DdpNames names);

  // The hook, hooks::allreduce() until one is registered.
  void set_hook(hooks::CommHookPtr hook) { hook_ = std::move(hook); }
  const hooks::CommHookPtr& hook() const { return hook_; }
  // Whether the ranks have compared their hooks (at the first bucket of
  // the first averaging); set between steps only (ddp.join(): the last
  // rank's word, for a rank that never averaged).
  bool hook_agreed() const { return hook_agreed_; }
  void set_hook_agreed(bool agreed) { hook_agreed_ = agreed; }

  // Posts `bucket`'s averaging: its task runs the hook on it (the first
  // bucket of the first averaging compares every rank's hook first) and
  // leaves its future, without waiting for it.
  CollectiveStream::Ticket post(const hooks::GradBucket& bucket);
  // An averaging backward began (its first gradient): posts a task that
  // announces its buckets (Channel::announce), where a hook of ours runs
  // them, so that their check is made while the backward computes.
  void announce(const hooks::GradBucket& first);
  // A backward's buckets are done (take() calls it): the next post() is
  // the next backward's first.
  void next_round() { ++round_; }
  // Posts the sum of `mine` (one number a parameter) over the ranks into `into`.
  CollectiveStream::Ticket post_count(const torch::Tensor& mine, std::shared_ptr<torch::Tensor> into);
  // Waits for every task posted since the last take(), then for every
  // bucket's average, and puts each in its bucket, times `scale` (ddp.join()
  // with divide_by_initial_world_size off: world size over active ranks);
  // a sparse bucket's sum is divided by `divisor` into its parameter's .grad.
  // Throws the first failure, in our words.
  void take(double scale, double divisor);

  const hooks::WireStats& wire() const { return wire_; }
  double wait_seconds() const { return wait_seconds_; }

 private:
  void communicate(const hooks::GradBucket& bucket, uint64_t round, Channel& channel);
  void agree_on_hook(Channel& channel);
  std::exception_ptr first_error(std::exception_ptr error, const hooks::GradBucket& bucket);

  std::shared_ptr<CollectiveStream> stream_;
  const DdpNames names_;
  hooks::CommHookPtr hook_;
  std::atomic<bool> hook_agreed_{false};  // written on the stream's thread
  std::atomic<bool> announcing_{true};    // until the channel says it never announces (on one host)
  hooks::WireStats wire_;     // written by the stream's tasks
  struct InFlight {
    hooks::GradBucket bucket;
    FuturePtr result;
  };
  std::mutex mutex_;
  std::vector<InFlight> in_flight_;                 // under mutex_
  std::vector<CollectiveStream::Ticket> posted_;    // under mutex_
  std::atomic<uint64_t> round_{1};  // backwards averaged so far, plus one: a DeterminedRun's id
  double wait_seconds_ = 0;
};

}  // namespace mnist_ddp
