#include "app/train/preemption.hpp"

#include <signal.h>

#include <atomic>

#include "comm/group.hpp"

namespace mnist_ddp {
namespace {

// In the order a vote prefers them.
constexpr int kStopSignals[] = {SIGTERM, SIGHUP, SIGUSR1};

std::atomic<int> g_preemption_signal{0};

void on_preemption_signal(int sig) { g_preemption_signal = sig; }

}  // namespace

void catch_preemption_signals() {
  struct sigaction action {};
  action.sa_handler = on_preemption_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int sig : kStopSignals) sigaction(sig, &action, nullptr);
}

std::string signal_name(int sig) {
  return sig == SIGTERM ? "SIGTERM" : sig == SIGUSR1 ? "SIGUSR1" : sig == SIGHUP ? "SIGHUP" : "signal " + std::to_string(sig);
}

int preemption_signal() { return g_preemption_signal; }

int StopVote::after_step() {
  int agreed = 0;
  if (votes_.defined()) {
    quick_stream(group_)->wait(ticket_);
    const torch::Tensor votes = votes_.cpu();
    for (int i = 2; i >= 0; --i)
      if (votes[i].item<double>() > 0) agreed = kStopSignals[i];
  }
  const int mine = preemption_signal();
  std::vector<double> seen;
  for (int sig : kStopSignals) seen.push_back(mine == sig ? 1.0 : 0.0);
  votes_ = torch::tensor(seen, torch::kFloat64).to(group_.device());
  ticket_ = quick_stream(group_)->post([votes = votes_](Channel& c) { c.allreduce_sum(votes)->waitAndThrow(); },
                                       "the stop vote after a step");
  return agreed;
}

}  // namespace mnist_ddp
