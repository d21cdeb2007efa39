#include "app/train/preemption.hpp"

#include <signal.h>

#include <atomic>

#include "comm/group.hpp"

namespace mnist_ddp {
namespace {

std::atomic<int> g_preemption_signal{0};

void on_preemption_signal(int sig) { g_preemption_signal = sig; }

}  // namespace

void catch_preemption_signals() {
  struct sigaction action {};
  action.sa_handler = on_preemption_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int sig : {SIGTERM, SIGUSR1}) sigaction(sig, &action, nullptr);
}

std::string signal_name(int sig) {
  return sig == SIGTERM ? "SIGTERM" : sig == SIGUSR1 ? "SIGUSR1" : "signal " + std::to_string(sig);
}

int preemption_signal() { return g_preemption_signal; }

int StopVote::after_step() {
  int agreed = 0;
  if (votes_.defined()) {
    quick_stream(group_)->wait(ticket_);
    const torch::Tensor votes = votes_.cpu();
    agreed = votes[0].item<double>() > 0 ? SIGTERM : votes[1].item<double>() > 0 ? SIGUSR1 : 0;
  }
  const int mine = preemption_signal();
  votes_ = torch::tensor({mine == SIGTERM ? 1.0 : 0.0, mine == SIGUSR1 ? 1.0 : 0.0}, torch::kFloat64).to(group_.device());
  ticket_ = quick_stream(group_)->post([votes = votes_](Channel& c) { c.allreduce_sum(votes)->waitAndThrow(); });
  return agreed;
}

}  // namespace mnist_ddp
