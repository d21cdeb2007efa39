// One iteration of a DistributedDataParallel, from a ddp.forward with
// gradients to its averages, as an explicit state machine. Not installed.
//
// Note on an iteration. A ddp.forward with gradients opens one; it averages
// once every parameter has what it gets in a step: a gradient each (several
// backward calls may bring them, a loss each), or, with static_graph, as
// many as the first step gave it. A bucket is posted as soon as its
// parameters are ready, in index order; the backward call that completes
// the last waits for every average. Parameters that get nothing are known
// at the forward where the graph can be walked (find_unused_parameters;
// static_graph's first step), else at the end of the backward call
// (find_unused_parameters with an output the walk cannot read), else they
// are a mistake named at the next forward, once the buckets have gone out.
//
// Phases and what moves between them:
//   closed ──forward──> averaging (learning: static_graph's first)
//   closed ──forward in no_sync()──> accumulating ──forward──> ...
//   averaging ──every bucket posted, end of a backward call──> closed
//   averaging ──end of a backward call, find_unused_parameters──> rounded
//     (what got no gradient is unused: an output the loss left out)
//   rounded ──another backward before the next forward──> averaging again
//     (each backward averages what it adds: the sum of the averages is the
//     average of the sum)
//   closed ──a backward with no forward of ours──> closed, bypassed
//     (model->forward's: named at the next forward once parameters moved)
// The machine decides; the DDP acts through Effects (linking a gradient to
// its bucket, posting a bucket), so the machine is tested without
// communication (tests/ddp_test.cpp).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "parallel/layout.hpp"

namespace mnist_ddp {

class Iteration {
 public:
  enum class Phase {
    closed,        // between iterations
    accumulating,  // a forward under no_sync(): backward accumulates, sends nothing
    learning,      // static_graph's first averaging: how many gradients each parameter gets, in which order
    averaging,     // buckets go out as their parameters are ready
    rounded,       // find_unused_parameters: a backward call averaged what it had; another may follow
  };
  // What the DDP does at the machine's word.
  class Effects {
   public:
    virtual ~Effects() = default;
    // Parameter p is ready with a gradient: its .grad must be its bucket's view.
    virtual void took_gradient(size_t p) = 0;
    // Parameter p is ready without one (unused): its bucket holds its .grad,
    // or zeros, and what .grad was is kept for close().
    virtual void counted_unused(size_t p) = 0;
    // Bucket b is ready: post it.
    virtual void bucket_ready(size_t b) = 0;
    // An averaging round's first gradient, where every rank's buckets can
    // go only after it (no find_unused_parameters, no static_graph: no
    // bucket is ever posted at a forward, and no rank's graph differs in
    // what it reaches): the buckets may be announced, once a round.
    virtual void round_began() {}
  };

  Iteration(size_t params, bool find_unused, bool static_graph, Effects& effects);
  // The buckets (again, after a rebuild).
  void use_layout(const BucketLayout& layout);

  Phase phase() const { return phase_; }
  // A backward call is running (its end not yet seen).
  bool in_backward() const { return in_backward_; }
  // A backward has begun since the DDP was built: too late for register_comm_hook.
  bool backward_seen() const { return backward_seen_; }
  // static_graph learned its order: the buckets are rebuilt at the next
  // forward, in `ready_order()`, once.
  bool rebuild_due() const { return rebuild_due_; }
  void rebuilt() { rebuild_due_ = false; }
  const std::vector<size_t>& ready_order() const { return ready_order_; }
  // What static_graph learned, as another rank's (ddp.join(): the last
  // rank's, for a rank that may never have stepped).
  const std::vector<int>& expected_fires() const { return expected_fires_; }
  void adopt(std::vector<int> expected_fires, std::vector<size_t> ready_order, bool rebuild_due);

  // A ddp.forward with gradients: opens an averaging iteration, or under
  // no_sync() an accumulating one. UsageError while a backward still runs.
  void open(bool no_sync);
  // Whether the forward's outputs should be walked for parameters they do
  // not reach (find_unused_parameters, static_graph's first step), and
  // what the walk found: `reached[p]`.
  bool wants_walk() const;
  void walked(const std::vector<bool>& reached);
  // Parameter p's accumulator added a gradient (`name` for errors).
  // Returns true where this starts a backward call (whose end the DDP
  // reports through end_backward()).
  bool gradient(size_t p, const std::string& name);
  // The end of a backward call.
  enum class End {
    ignored,   // not an iteration's (accumulating, closed)
    bypassed,  // a backward with no ddp.forward: gradients no rank averaged
    open,      // more backward calls are to come
    complete,  // every bucket is posted: close() and wait for the averages
  };
  End end_backward();
  // Counts every parameter not yet ready as unused (posting what is
  // left), closes the iteration, and returns which parameters received a
  // gradient since the last averaging (no_sync's micro-batches included).
  std::vector<bool> close();
  // At a forward: what the last iteration left open. `had_gradients`
  // false: a forward without a backward (nothing to name).
  struct LeftOpen {
    bool open = false;
    bool had_gradients = false;
    std::string missing;  // " a.weight b.bias": parameters not ready
  };
  LeftOpen left_open(const std::vector<std::string>& names) const;

 private:
  void ready(size_t p);
  void post_ready_buckets();
  void rearm();  // a fresh averaging round: nothing ready, every bucket to go

  const size_t params_;
  const bool find_unused_, static_graph_;
  Effects& effects_;
  std::vector<size_t> bucket_of_, bucket_sizes_;
  Phase phase_ = Phase::closed;
  bool in_backward_ = false, backward_seen_ = false;
  bool bypassed_ = false;      // the running backward call follows no ddp.forward
  bool unused_found_ = false;  // what gets no gradient is known (the walk, or static_graph)
  std::vector<int> pending_;   // bucket -> gradients not yet ready
  std::vector<bool> ready_;    // param -> ready in this iteration
  std::vector<int> fires_;     // param -> gradients it received in this iteration
  size_t next_bucket_ = 0;     // buckets [0, next_bucket_) are posted
  bool began_ = false;         // round_began() said in this round
  std::vector<bool> used_;     // param -> received a gradient since the last averaging
  // static_graph: what the first averaging iteration learned.
  std::vector<int> expected_fires_;  // param -> gradients a step gives it; empty before
  std::vector<size_t> ready_order_;  // params in the order of their first gradient
  bool rebuild_due_ = false;
};

}  // namespace mnist_ddp
