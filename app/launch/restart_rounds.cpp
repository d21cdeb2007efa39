#include "app/launch/restart_rounds.hpp"

#include <cctype>
#include <cstdlib>
#include <thread>

namespace mnist_ddp {
namespace {

// How long a check for another node's request may take: the supervisor
// polls it every 250 ms between reaping its workers and reading signals.
constexpr auto kPollLimit = std::chrono::seconds(2);

}  // namespace

RestartRounds::RestartRounds(StorePtr store, int node_rank, int nnodes, std::chrono::milliseconds timeout)
    : poll_(store, std::min<std::chrono::milliseconds>(timeout, kPollLimit), "node 0's store"),
      store_(store, timeout, "node 0's store"),
      node_rank_(node_rank),
      nnodes_(nnodes),
      timeout_(timeout) {}

std::string RestartRounds::key(int round, const std::string& what) const {
  return "restart/" + std::to_string(round) + "/" + what;
}

std::optional<std::string> RestartRounds::from_a_node(const std::string& value) const {
  // "node <k>: why" or "node <k> stopped...", k one of the job's nodes.
  if (value.rfind("node ", 0) != 0 || value.size() > 4096) return std::nullopt;
  char* end = nullptr;
  const long k = std::strtol(value.c_str() + 5, &end, 10);
  if (end == value.c_str() + 5 || k < 0 || k >= nnodes_ || (*end != ':' && *end != ' ')) return std::nullopt;
  std::string shown;
  for (char c : value) shown += std::isprint(static_cast<unsigned char>(c)) ? c : '?';
  return shown;
}

std::optional<std::string> RestartRounds::requested(int round) {
  if (nnodes_ == 1 || store_lost_) return std::nullopt;
  try {
    if (poll_.check({key(round, "cause")})) return from_a_node(poll_.get(key(round, "cause")));
  } catch (const StoreStalled&) {
    // Asked again at the next poll; a stalled store asks for nothing meanwhile.
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
    const std::string mine = "node " + std::to_string(node_rank_) + ": " + cause;
    std::string held = store_.compare_set(key(round, "cause"), "", mine);
    if (!from_a_node(held)) held = store_.compare_set(key(round, "cause"), held, mine);  // not a node's: replaced
    why = from_a_node(held).value_or(mine);
    store_.set(key(round, "node/" + std::to_string(node_rank_)), "ready");
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      if (store_.check({key(round, "refused")}))
        if (auto refused = from_a_node(store_.get(key(round, "refused")))) return {false, *refused};
      std::string missing;
      for (int k = 0; k < nnodes_; ++k) {
        const std::string ready = key(round, "node/" + std::to_string(k));
        if (!store_.check({ready}) || store_.get(ready) != "ready")
          missing += (missing.empty() ? "" : ", ") + std::to_string(k);
      }
      if (missing.empty()) return {true, why};
      if (std::chrono::steady_clock::now() > deadline)
        return {false, "node " + missing + " did not join restart " + std::to_string(round) + " within " +
                           std::to_string(timeout_.count() / 1000) + " s (after " + why + ")"};
      if (interrupted()) return {false, ""};
    }
  } catch (const StoreStalled& e) {
    store_lost_ = true;
    return {false, std::string(e.what()) + " while restarting after " + why};
  } catch (const std::exception&) {
    store_lost_ = true;
    return {false, "lost the rendezvous store on node 0 (its launcher stopped) while restarting after " + why};
  }
}

void RestartRounds::preempt(int round, const std::string& signal) {
  if (nnodes_ == 1 || store_lost_) return;
  try {
    poll_.compare_set("preempted/" + std::to_string(round), "", "node " + std::to_string(node_rank_) + ": " + signal);
  } catch (const std::exception&) {
  }
}

std::optional<std::string> RestartRounds::preempted(int round, std::chrono::milliseconds wait) {
  if (nnodes_ == 1 || store_lost_) return std::nullopt;
  const std::string key = "preempted/" + std::to_string(round);
  const auto deadline = std::chrono::steady_clock::now() + wait;
  try {
    for (;;) {
      if (poll_.check({key})) return from_a_node(poll_.get(key));
      if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

void RestartRounds::refuse(int round, const std::string& why) {
  if (nnodes_ == 1 || store_lost_) return;
  try {
    poll_.compare_set(key(round, "refused"), "", why);
  } catch (const std::exception&) {
  }
}

}  // namespace mnist_ddp
