#include "mnist_ddp/launch/restart_rounds.hpp"

#include "mnist_ddp/comm/store.hpp"

namespace mnist_ddp {

RestartRounds::RestartRounds(c10d::Store& store, int node_rank, int nnodes, std::chrono::milliseconds timeout)
    : store_(store), node_rank_(node_rank), nnodes_(nnodes), timeout_(timeout) {}

std::string RestartRounds::key(int round, const std::string& what) const {
  return "restart/" + std::to_string(round) + "/" + what;
}

std::optional<std::string> RestartRounds::requested(int round) {
  if (nnodes_ == 1 || store_lost_) return std::nullopt;
  try {
    if (store_.check({key(round, "cause")})) return text_of(store_.get(key(round, "cause")));
  } catch (const std::exception&) {
    store_lost_ = true;
  }
  return std::nullopt;
}

RestartRounds::Outcome RestartRounds::join(int round, const std::string& cause,
                                           const std::function<bool()>& interrupted) {
  if (nnodes_ == 1) return {true, cause};
  std::string why = cause;
  try {
    why = text_of(store_.compareSet(key(round, "cause"), {}, bytes_of("node " + std::to_string(node_rank_) + ": " + cause)));
    store_.set(key(round, "node/" + std::to_string(node_rank_)), bytes_of("ready"));
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      if (store_.check({key(round, "refused")})) return {false, text_of(store_.get(key(round, "refused")))};
      std::string missing;
      for (int k = 0; k < nnodes_; ++k)
        if (!store_.check({key(round, "node/" + std::to_string(k))}))
          missing += (missing.empty() ? "" : ", ") + std::to_string(k);
      if (missing.empty()) return {true, why};
      if (std::chrono::steady_clock::now() > deadline)
        return {false, "node " + missing + " did not join restart " + std::to_string(round) + " within " +
                           std::to_string(timeout_.count() / 1000) + " s (after " + why + ")"};
      if (interrupted()) return {false, ""};
    }
  } catch (const std::exception&) {
    store_lost_ = true;
    return {false, "lost the rendezvous store on node 0 (its launcher stopped) while restarting after " + why};
  }
}

void RestartRounds::refuse(int round, const std::string& why) {
  if (nnodes_ == 1 || store_lost_) return;
  try {
    store_.compareSet(key(round, "refused"), {}, bytes_of(why));
  } catch (const std::exception&) {
  }
}

}  // namespace mnist_ddp
