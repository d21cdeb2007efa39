// How every node's launcher agrees on restarting the job's workers: a small
// protocol over the job's store, no collectives.
//
// The launchers start their workers in rounds: 0, then one more per
// restart. Keys, for the round `n` being agreed:
//   restart/<n>/cause     set by the first launcher that asks for it: why
//   restart/<n>/node/<k>  node k's workers are stopped and it is ready
//   restart/<n>/refused   set by a node that will not take part: why
//   preempted/<n>         set by a node whose launcher a preemption signal
//                         reached during round n: "node <k>: SIGTERM"
// A round starts once every node is ready; it does not start when a node
// refuses, or does not answer within the timeout.
//
// Anyone who reaches the store can write these keys, so what is read is
// checked: a cause or refusal counts only as "node <k>..." with k one of
// the job's nodes, a node is ready only at "ready"; anything else is not a
// node's word and is ignored (a cause is overwritten). Requests are bounded
// (store.hpp, "Note on stalls"): a stalled store asks for no restart.
//
// Every call runs on the calling thread and blocks at most as its comment
// says; one object per launcher.
#pragma once

#include "comm/store.hpp"

#include <chrono>
#include <functional>
#include <optional>
#include <string>

namespace mnist_ddp {

class RestartRounds {
 public:
  RestartRounds(StorePtr store, int node_rank, int nnodes, std::chrono::milliseconds timeout);

  // Another node's request for round `round`: its cause, if any. A store
  // that is gone or stalled asks nothing (node 0 may be done). Blocks at
  // most 2 s.
  std::optional<std::string> requested(int round);

  // What joining a round came to.
  struct Outcome {
    bool start = false;  // every node is ready: start round `round`
    // Why: the cause every node restarts for ("node 1: ..."), or why the
    // round does not happen ("node 2 did not join restart 1 within 300 s
    // (after ...)", another node's refusal). "" when `interrupted` said so.
    std::string why;
  };
  // Asks for round `round` because of `cause` (this node's failure), or
  // joins the request another node made first, whose cause the outcome
  // then carries; then waits up to the timeout for every node, calling
  // `interrupted` between checks (it may block briefly; true stops the
  // wait). A single node starts the round at once.
  Outcome join(int round, const std::string& cause, const std::function<bool()>& interrupted);

  // Tells the other nodes that this one will not take part in round `round`.
  void refuse(int round, const std::string& why);

  // Tells the other nodes that a preemption signal (`signal`: "SIGTERM")
  // reached this node's launcher during round `round`; and which node's
  // did, if one said so within `wait` (nullopt otherwise).
  void preempt(int round, const std::string& signal);
  std::optional<std::string> preempted(int round, std::chrono::milliseconds wait);

 private:
  std::string key(int round, const std::string& what) const;
  // `value` as a node's message, made printable; nullopt when no node wrote it.
  std::optional<std::string> from_a_node(const std::string& value) const;

  StoreClient poll_;   // for requested() and refuse(): short requests
  StoreClient store_;  // for join(): requests of up to the timeout
  const int node_rank_, nnodes_;
  const std::chrono::milliseconds timeout_;
  bool store_lost_ = false;
};

}  // namespace mnist_ddp
