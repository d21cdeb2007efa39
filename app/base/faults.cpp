#include "app/base/faults.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace mnist_ddp {

int64_t Faults::step_for(const std::vector<AtStep>& points, int restart, int rank) {
  for (const AtStep& p : points)
    if (p.restart == restart && p.rank == rank) return p.step;
  return -1;
}

std::vector<Faults::AtStep> Faults::parse_steps(const std::string& spec) {
  std::vector<AtStep> out;
  std::istringstream entries(spec);
  for (std::string entry; std::getline(entries, entry, ',');) {
    AtStep p;
    long long step = -1;
    if (std::sscanf(entry.c_str(), "%d:%d:%lld", &p.restart, &p.rank, &step) == 3) {
      p.step = step;
      out.push_back(p);
    }
  }
  return out;
}

Faults faults_from(const Environment& env) {
  Faults faults;
  faults.kill_at_write = std::max(0, std::atoi(env.get("MNIST_DDP_KILL_AT_WRITE").value_or("0").c_str()));
  faults.kill_after_step = Faults::parse_steps(env.get("MNIST_DDP_KILL_AFTER_STEP").value_or(""));
  faults.pause_after_step = Faults::parse_steps(env.get("MNIST_DDP_PAUSE_AFTER_STEP").value_or(""));
  faults.hold_workers_until = env.get("MNIST_DDP_HOLD_WORKERS_UNTIL").value_or("");
  faults.without_cgroup = env.get("MNIST_DDP_WITHOUT_CGROUP").value_or("") == "1";
  return faults;
}

}  // namespace mnist_ddp
