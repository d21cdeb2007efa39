// A program's own collectives on a ProcessGroup (blocking, and as Works),
// its subgroups (new_group), and shutdown() (process_group.hpp).
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>

#include "mnist_ddp/base/errors.hpp"
#include "mnist_ddp/comm/process_group.hpp"
#include "comm/group.hpp"

namespace mnist_ddp {

struct Work::State {
  std::shared_ptr<CollectiveStream> stream;
  CollectiveStream::Ticket ticket = 0;
  FuturePtr future;
};

void Work::wait() const { state_->stream->wait(state_->ticket); }
bool Work::wait(std::chrono::milliseconds timeout) const {
  if (!state_->stream->wait_for(state_->ticket, timeout)) return false;
  wait();
  return true;
}
bool Work::is_completed() const { return state_->future->completed(); }
bool Work::is_success() const { return state_->future->completed() && !state_->future->hasError(); }
std::exception_ptr Work::exception() const {
  return state_->future->completed() && state_->future->hasError() ? state_->future->exception_ptr() : nullptr;
}
FuturePtr Work::get_future() const { return state_->future; }

namespace {

// What a collective of the program's may be given: UsageError at the call,
// before anything is posted, naming the call (`what`) and what is wrong.
void check_tensor(const GroupState& s, const std::string& what, const at::Tensor& t, bool written) {
  if (!t.defined()) throw UsageError(what + ": the tensor is undefined");
  if (t.device() != s.device)
    throw UsageError(what + ": the tensor is on " + t.device().str() + ", the group's device is " + s.device.str());
  if (written && t.requires_grad())
    throw UsageError(what + ": the tensor requires grad, and a collective writes into it: pass t.detach() (or "
                            "work under torch::NoGradGuard)");
}

void check_root(const GroupState& s, const std::string& what, int root) {
  if (root < 0 || root >= s.world_size)
    throw UsageError(what + ": root " + std::to_string(root) + " is not a rank of the group (0 to " +
                     std::to_string(s.world_size - 1) + ")");
}

// `task` on the group's quick stream, as a Work whose future holds what
// the task returns.
Work post(const GroupState& s, const std::string& issuer, std::function<c10::IValue(Channel&)> task) {
  auto state = std::make_shared<Work::State>();
  state->stream = s.quick;
  std::tie(state->ticket, state->future) = s.quick->post_for(std::move(task), issuer);
  return GroupAccess::work(std::move(state));
}

}  // namespace

Work ProcessGroup::allreduce_sum_async(at::Tensor& tensor) const {
  const std::string what = "the program's own allreduce_sum";
  check_tensor(*state_, what, tensor, true);
  return post(*state_, what, [tensor](Channel& c) {
    c.allreduce_sum(tensor)->waitAndThrow();
    return c10::IValue(tensor);
  });
}

Work ProcessGroup::broadcast_async(at::Tensor& tensor, int root) const {
  const std::string what = "the program's own broadcast";
  check_tensor(*state_, what, tensor, true);
  check_root(*state_, what, root);
  return post(*state_, what, [tensor, root](Channel& c) {
    at::Tensor t = tensor;
    c.broadcast(t, root);
    return c10::IValue(t);
  });
}

Work ProcessGroup::allgather_async(const at::Tensor& tensor) const {
  const std::string what = "the program's own allgather";
  check_tensor(*state_, what, tensor, false);
  return post(*state_, what, [tensor](Channel& c) { return c10::IValue(c.allgather(tensor.detach())); });
}

// NCCL's own reduce_scatter; over Gloo, a sum of the whole input, each
// rank keeping its chunk (Link::reduce_scatter_sum).
Work ProcessGroup::reduce_scatter_async(at::Tensor& output, const at::Tensor& input) const {
  const std::string what = "the program's own reduce_scatter";
  check_tensor(*state_, what, output, true);
  check_tensor(*state_, what, input, false);
  if (input.numel() != output.numel() * state_->world_size || input.scalar_type() != output.scalar_type())
    throw UsageError(what + ": the input must hold world_size() (" + std::to_string(state_->world_size) +
                     ") chunks of the output's size and dtype, got " + std::to_string(input.numel()) +
                     " elements for an output of " + std::to_string(output.numel()));
  return post(*state_, what, [output, input](Channel& c) {
    c.reduce_scatter_sum(output, input.detach());
    return c10::IValue(output);
  });
}

Work ProcessGroup::barrier_async() const {
  return post(*state_, "the program's own barrier", [](Channel& c) {
    c.barrier();
    return c10::IValue();
  });
}

void ProcessGroup::allreduce_sum(at::Tensor& tensor) const { allreduce_sum_async(tensor).wait(); }
void ProcessGroup::broadcast(at::Tensor& tensor, int root) const { broadcast_async(tensor, root).wait(); }
at::Tensor ProcessGroup::allgather(const at::Tensor& tensor) const {
  const Work work = allgather_async(tensor);
  work.wait();
  return work.get_future()->value().toTensor();
}
void ProcessGroup::reduce_scatter(at::Tensor& output, const at::Tensor& input) const {
  reduce_scatter_async(output, input).wait();
}
void ProcessGroup::barrier() const { barrier_async().wait(); }

void ProcessGroup::shutdown() const {
  GroupState& s = base_of(*this);
  s.shut_down = true;
  const auto why = std::make_exception_ptr(PeerLost("the process group was shut down (ProcessGroup::shutdown)"));
  const auto later = std::make_exception_ptr(UsageError(
      "the process group was shut down (ProcessGroup::shutdown): no collective runs on it after that"));
  std::vector<std::shared_ptr<CollectiveStream>> streams;
  for (const auto& weak : s.streams)
    if (auto stream = weak.lock()) streams.push_back(std::move(stream));
  for (const auto& stream : streams) stream->abandon(why, later);
  // Every collective waiting in a check or a transfer ends with it; NCCL's
  // communicators are aborted, so that kernels waiting on a peer return.
  if (s.watch)
    s.watch->shut_down(why, [streams] {
      for (const auto& stream : streams) stream->abort_backend();
    });
  else
    for (const auto& stream : streams) stream->abort_backend();
}

std::optional<ProcessGroup> new_group(const ProcessGroup& group, std::vector<int> ranks) {
  GroupState& base = base_of(group);
  std::sort(ranks.begin(), ranks.end());
  std::string listed;
  for (int r : ranks) listed += (listed.empty() ? "" : ", ") + std::to_string(r);
  if (ranks.empty()) throw UsageError("new_group: no ranks");
  if (std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end())
    throw UsageError("new_group: ranks " + listed + " name a rank twice");
  if (ranks.front() < 0 || ranks.back() >= base.world_size)
    throw UsageError("new_group: ranks " + listed + " are not all ranks of the group (0 to " +
                     std::to_string(base.world_size - 1) + ")");
  // Every rank must ask for the same subgroup, in the same order.
  const int n = ++base.groups_made;
  const std::string difference =
      base.quick->disagreement({{"new_group " + std::to_string(n), listed}}, "new_group",
                               "every rank must call new_group, with the same ranks, in the same order",
                               "new_group " + std::to_string(n));
  if (!difference.empty()) throw UsageError(difference);
  const auto me = std::find(ranks.begin(), ranks.end(), base.rank);
  if (me == ranks.end()) return std::nullopt;
  // Its lines name its ranks as the job does, and name it.
  RankNames names;
  const RankNames* job = base.watch ? &base.watch->names() : nullptr;
  for (int r : ranks) names.global.push_back(job && !job->global.empty() ? job->global.at(static_cast<size_t>(r)) : r);
  names.group = "new_group " + std::to_string(n) + " (" + RankNames().list(names.global) + ")";
  auto state = form(c10::make_intrusive<c10d::PrefixStore>("group/" + std::to_string(n), base.store),
                    static_cast<int>(me - ranks.begin()), static_cast<int>(ranks.size()), backend_named(base.backend),
                    base.device, base.timeout, base.shared_memory, base.gloo_address, base.check, std::move(names));
  state->restart = base.restart;
  state->launcher = base.launcher;
  // Its local ranks: the members on this rank's node, in rank order.
  const auto node = [&](int r) {
    return base.node_of_rank.empty() ? r / std::max(1, base.local_world_size) : base.node_of_rank[r];
  };
  state->local_rank = static_cast<int>(
      std::count_if(ranks.begin(), me, [&](int r) { return node(r) == node(base.rank); }));
  state->local_world_size =
      static_cast<int>(std::count_if(ranks.begin(), ranks.end(), [&](int r) { return node(r) == node(base.rank); }));
  for (int r : ranks)
    if (r < static_cast<int>(base.node_of_rank.size())) state->node_of_rank.push_back(base.node_of_rank[r]);
  return GroupAccess::make(state);
}

}  // namespace mnist_ddp
