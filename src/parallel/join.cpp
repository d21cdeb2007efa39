// ddp.join(): uneven inputs, as a layer above the DDP (distributed.hpp).
//
// Note on join. While join() runs the loop, every forward with gradients
// first counts the ranks that still have data: a vote, one small sum on
// the model's quick lane, tagged so that a rank that abstains knows it.
// A rank whose loop has ended abstains on its DDP's own lanes (the quick
// one and the buckets'), and serves what the others issue there, with
// zeros: their buckets' sums (its gradients count as zero), their
// SyncBatchNorm statistics, their broadcasts (received, never sent: a
// broadcast from a rank that has joined is refused on every rank). The
// vote bounds every wait of a rank that has joined to one step of the
// others, so no wait spans their training. Each lane's serving ends when
// every rank abstains at one check: every rank has joined. Then the rank
// that took the most steps (it joined last) gives every rank its
// parameters, buffers, the hook's shared state and what static_graph
// learned, so the replicas end identical, as PyTorch's join broadcasts the
// last rank's model. With throw_on_early_termination, every rank throws at
// the first vote that counts fewer ranks than the world, after ending the
// buckets' lane's serving alike, so the group stays usable.
#include "parallel/reducer.hpp"

#include <optional>

#include "mnist_ddp/base/errors.hpp"
#include "comm/group.hpp"

namespace mnist_ddp {

using detail::Reducer;

namespace {

constexpr int kVoteTag = 1;  // the check's tag on a vote (Channel::tag_next)

// What a lane's serving task found: every rank abstained, or (the quick
// lane) a vote, whose sum it returns.
struct Served {
  bool everyone_joined = false;
  torch::Tensor vote;
};

// A task that abstains on its lane and serves what the others issue until
// every rank abstains, or (`until_vote`) until it has served a vote.
CollectiveStream::Task serving(const Issuer& as, bool until_vote, std::shared_ptr<Served> out) {
  return [as, until_vote, out](Channel& c) {
    for (;;) {
      const std::optional<Channel::Issued> issued = c.abstain(as);
      if (!issued) {
        out->everyone_joined = true;
        return;
      }
      torch::Tensor result = c.serve(*issued);
      if (until_vote && issued->tag == kVoteTag) {
        out->vote = result.cpu();
        return;
      }
    }
  };
}

std::string ranks_named(const torch::Tensor& with_data) {
  std::vector<int> joined;
  for (int64_t r = 0; r < with_data.numel(); ++r)
    if (with_data[r].item<double>() == 0) joined.push_back(static_cast<int>(r));
  std::string who;
  for (int r : joined) who += (who.empty() ? "" : ", ") + std::to_string(r);
  return (joined.size() > 1 ? "ranks " : "rank ") + who;
}

// One join() in progress on this rank.
class JoinRun {
 public:
  JoinRun(Reducer& ddp, const JoinOptions& options) : ddp_(ddp), options_(options) {
    ddp_.join_with([this] { return vote(); });
  }
  ~JoinRun() { ddp_.join_with(nullptr); }
  JoinRun(const JoinRun&) = delete;
  JoinRun& operator=(const JoinRun&) = delete;

  // A step's count of the ranks with data; the scale of its averages.
  double vote();
  // This rank's loop has ended: serves the others until every rank has
  // joined; returns the rank that joined last.
  int serve();
  // Every rank abstains once on the buckets' lane: how the ranks that
  // serve it learn that no bucket will come (a step that every rank
  // refused, or throw_on_early_termination).
  void end_bulk_serving();

 private:
  Issuer as(IssuerKind kind, const std::string& what) const { return ddp_.issuer(kind, what); }
  bool two_lanes() const { return ddp_.bulk() != ddp_.quick(); }
  [[noreturn]] void stop_everyone(const torch::Tensor& with_data);
  int last_to_join();

  Reducer& ddp_;
  const JoinOptions options_;
  int64_t steps_ = 0;  // votes this rank cast with data
};

double JoinRun::vote() {
  const ProcessGroup& group = ddp_.process_group();
  auto mine = torch::zeros({group.world_size()}, torch::kFloat64);
  mine[group.rank()] = 1;
  auto with = std::make_shared<torch::Tensor>();
  ddp_.quick()->run(
      [mine, with](Channel& c) {
        torch::Tensor sum = mine.to(c.staging());
        c.tag_next(kVoteTag);
        c.allreduce_sum(sum)->waitAndThrow();
        *with = sum.cpu();
      },
      as(kJoinVote, "ddp.join(): the count of the ranks with data"));
  const torch::Tensor with_data = *with;
  const double active = with_data.sum().item<double>();
  ++steps_;
  if (active < group.world_size() && options_.throw_on_early_termination()) {
    end_bulk_serving();
    stop_everyone(with_data);
  }
  return options_.divide_by_initial_world_size() ? 1.0 : group.world_size() / active;
}

void JoinRun::end_bulk_serving() {
  if (!two_lanes()) return;
  auto out = std::make_shared<Served>();
  ddp_.bulk()->run(serving(as(kJoined, "ddp.join(): the end of serving"), false, out),
                   as(kJoined, "ddp.join(): the end of serving"));
}

void JoinRun::stop_everyone(const torch::Tensor& with_data) {
  throw Error("ddp.join(): " + ranks_named(with_data) +
              " ran out of inputs, and throw_on_early_termination stops every rank there");
}

int JoinRun::serve() {
  const Issuer joined = as(kJoined, "ddp.join(): its data ran out");
  std::optional<CollectiveStream::Ticket> bulk;
  if (two_lanes()) bulk = ddp_.bulk()->post(serving(joined, false, std::make_shared<Served>()), joined);
  std::optional<torch::Tensor> stopped;
  std::exception_ptr failed;
  try {
    for (;;) {
      auto out = std::make_shared<Served>();
      ddp_.quick()->run(serving(joined, true, out), joined);
      if (out->everyone_joined) break;
      if (options_.throw_on_early_termination()) {
        stopped = out->vote;
        break;
      }
    }
  } catch (...) {  // refused on every rank (the others end the buckets' serving with it), or worse
    failed = std::current_exception();
  }
  try {
    if (bulk) ddp_.bulk()->wait(*bulk);
  } catch (...) {
    if (!failed) failed = std::current_exception();
  }
  if (failed) std::rethrow_exception(failed);
  if (stopped) stop_everyone(*stopped);
  return last_to_join();
}

// Every rank has joined: the one that cast the most votes with data (the
// lowest such rank where several did) joined last.
int JoinRun::last_to_join() {
  const ProcessGroup& group = ddp_.process_group();
  auto steps = torch::zeros({group.world_size()}, torch::kFloat64);
  steps[group.rank()] = static_cast<double>(steps_);
  auto sum = std::make_shared<torch::Tensor>();
  ddp_.quick()->run(
      [steps, sum](Channel& c) {
        *sum = steps.to(c.staging());
        c.allreduce_sum(*sum)->waitAndThrow();
      },
      as(kJoinEnd, "ddp.join(): the ranks' steps"));
  return static_cast<int>(sum->cpu().argmax().item<int64_t>());
}

// The hook's shared state (PowerSGD's step count, P and Q) of rank
// `source`: each rank's own (its error feedback) stays its own.
void take_hook_state(CollectiveStream& quick, hooks::CommHook& hook, int source, int rank, const Issuer& issuer) {
  hooks::HookState state = hook.state();
  c10::Dict<std::string, torch::Tensor> shared;
  for (const auto& [key, t] : state.shared) shared.insert(key, t.detach().cpu());
  std::vector<char> bytes = rank == source ? torch::pickle_save(c10::IValue(shared)) : std::vector<char>();
  auto size = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kInt64).to(quick.device());
  quick.broadcast(size, source, issuer);
  const int64_t n = size.cpu().item<int64_t>();
  if (n == 0) return;
  bytes.resize(static_cast<size_t>(n));
  auto data = torch::from_blob(bytes.data(), {n}, torch::kUInt8).to(quick.device(), false, /*copy=*/true);
  quick.broadcast(data, source, issuer);
  const auto cpu = data.cpu();
  bytes.assign(static_cast<const char*>(cpu.data_ptr()), static_cast<const char*>(cpu.data_ptr()) + n);
  state.shared.clear();
  for (const auto& item : torch::pickle_load(bytes).toGenericDict())
    state.shared[item.key().toStringRef()] = item.value().toTensor();
  hook.load_state(state);
}

}  // namespace

void Reducer::join(const std::function<void()>& loop, const JoinOptions& options) {
  if (!options.enable() || group_.world_size() == 1) return loop();
  if (GroupAccess::state(group_).check == Check::off)
    throw UsageError("ddp.join() needs the collective check, which tells a rank whose data ran out what the others "
                     "issue: leave ProcessGroupOptions().check_collectives on");
  if (std::any_of(params_.begin(), params_.end(), [](const AveragedParam& p) { return p.sparse; }))
    throw UsageError("ddp.join(): a model with sparse gradients cannot be joined (a rank that ran out cannot serve a "
                     "sparse sum whose shape it does not know); give every rank as many batches");
  int source = 0;
  {
    JoinRun run(*this, options);
    try {
      loop();
    } catch (const RefusedEverywhere&) {  // every rank refused it: those that joined wait for word
      run.end_bulk_serving();
      throw;
    }
    check_bypass();
    source = run.serve();
  }
  torch::NoGradGuard no_grad;
  const Issuer from = issuer(kJoinEnd, "ddp.join(): the state of rank " + std::to_string(source) + ", which joined last");
  for (auto t : state_tensors()) {
    torch::Tensor value = t.is_complex() ? torch::view_as_real(t.detach()) : t.detach();
    quick_->broadcast(value, source, from);
  }
  take_hook_state(*quick_, *averager_->hook(), source, group_.rank(), from);
  torch::Tensor taught = learned().to(quick_->device());
  quick_->broadcast(taught, source, from);
  adopt(taught.cpu());
}

// What a DDP learned from its steps, as the last rank to join gives it to
// every rank: [static_graph learned, rebuild due, hooks compared, the
// layout's order (P), expected gradients (P), the ready order (P)].
torch::Tensor Reducer::learned() const {
  const auto n = static_cast<int64_t>(params_.size());
  auto t = torch::zeros({3 + 3 * n}, torch::kInt64);
  const auto& expected = iteration_->expected_fires();
  t[0] = expected.empty() ? 0 : 1;
  t[1] = iteration_->rebuild_due() ? 1 : 0;
  t[2] = averager_->hook_agreed() ? 1 : 0;
  for (int64_t p = 0; p < n; ++p) t[3 + p] = static_cast<int64_t>(layout_->order()[p]);
  for (size_t p = 0; p < expected.size(); ++p) t[3 + n + p] = expected[p];
  const auto& order = iteration_->ready_order();
  for (size_t k = 0; k < order.size() && k < params_.size(); ++k) t[3 + 2 * n + k] = static_cast<int64_t>(order[k]);
  return t;
}

void Reducer::adopt(const torch::Tensor& learned) {
  const auto n = static_cast<int64_t>(params_.size());
  std::vector<size_t> layout, order;
  std::vector<int> expected;
  for (int64_t p = 0; p < n; ++p) layout.push_back(static_cast<size_t>(learned[3 + p].item<int64_t>()));
  if (learned[0].item<int64_t>() != 0)
    for (int64_t p = 0; p < n; ++p) {
      expected.push_back(static_cast<int>(learned[3 + n + p].item<int64_t>()));
      order.push_back(static_cast<size_t>(learned[3 + 2 * n + p].item<int64_t>()));
    }
  averager_->set_hook_agreed(learned[2].item<int64_t>() != 0);
  std::lock_guard<std::mutex> lock(mutex_);
  iteration_->adopt(std::move(expected), std::move(order), learned[1].item<int64_t>() != 0);
  if (layout != layout_->order()) make_buckets(layout);
}

void Reducer::join_with(std::function<double()> counting) {
  counting_ = std::move(counting);
  scale_ = 1;
}

}  // namespace mnist_ddp
