#include "comm/rendezvous.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "mnist_ddp/base/errors.hpp"

namespace mnist_ddp {

// What a rank says when the store stops answering: its host stopped, and
// whoever stopped it says why.
PeerLost store_lost(const std::exception& e) {
  return PeerLost("lost the rendezvous store (its host stopped): " + error_line(e));
}

// The local address that packets to `host` leave from: Gloo listens there, so
// peers on other machines can reach it. Loopback for a single-node job.
std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || !res)
    throw std::runtime_error("cannot resolve --master-addr " + host);
  std::string address = "127.0.0.1";
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof local;
    char text[INET_ADDRSTRLEN];
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        inet_ntop(AF_INET, &local.sin_addr, text, sizeof text))
      address = text;
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return address;
}


namespace {

// Waits for `keys`; on timeout throws `describe(missing keys)`; a store
// that stopped answering is StoreStalled, one that went away PeerLost.
// `check`, if given, runs about once a second while waiting, to fail early.
void wait_for(const StoreClient& store, const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
              const std::function<std::string(const std::vector<std::string>&)>& describe,
              const std::function<void()>& check = nullptr) {
  std::vector<std::string> missing = keys;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    try {
      missing = store.wait(missing, check ? std::min<std::chrono::milliseconds>(left, std::chrono::seconds(1)) : left);
    } catch (const StoreStalled&) {
      throw;
    } catch (const std::exception& e) {
      throw store_lost(e);
    }
    if (check) check();
    if (missing.empty() || std::chrono::steady_clock::now() >= deadline) break;
  }
  if (!missing.empty()) throw std::runtime_error(describe(missing));
}

// Values in the store are anyone's to write who can reach it: what the
// rendezvous reads is checked, and a value no mnist_ddp wrote is named.
std::runtime_error foreign_value(const StoreClient& store, const std::string& key, const std::string& value) {
  std::string shown;
  for (char c : value.substr(0, 40)) shown += std::isprint(static_cast<unsigned char>(c)) ? c : '?';
  return std::runtime_error(store.where() + " holds '" + shown + "' at " + key +
                            ", which no mnist_ddp wrote: another process is writing into this job's store");
}

// How a node's launcher claims its --node-rank: its host and pid, so that
// a second launcher with the same --node-rank is told from the first, and
// from anything else a process could write there.
const std::string kClaim = "mnist_ddp launcher ";

std::string this_launchers_claim() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return kClaim + "pid " + std::to_string(getppid()) + " on " + host;
}

// The numbers in keys like "nodes/3/size" or "settings/3", joined: "1, 3".
std::string numbers_in(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) {
    const size_t a = k.find('/') + 1, b = k.find('/', a);
    out += (out.empty() ? "" : ", ") + k.substr(a, b == std::string::npos ? std::string::npos : b - a);
  }
  return out;
}

std::map<std::string, std::string> parse_settings(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const size_t eq = line.find('=');
    out[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return out;
}

// Throws naming the first setting in which `theirs` (rank `other`) differs from `mine`.
void compare_settings(const std::string& mine, int me, const std::string& theirs, int other) {
  const auto a = parse_settings(mine), b = parse_settings(theirs);
  std::map<std::string, std::string> names(a);  // either side's, in order
  names.insert(b.begin(), b.end());
  for (const auto& [name, unused] : names) {
    const auto mine_it = a.find(name), it = b.find(name);
    const std::string value = mine_it == a.end() ? "(none)" : mine_it->second;
    const std::string other_value = it == b.end() ? "(none)" : it->second;
    if (other_value == value) continue;
    throw std::runtime_error(name + " differs between ranks: rank " + std::to_string(me) + " has '" + value +
                             "', rank " + std::to_string(other) + " has '" + other_value +
                             "'; every rank must run with the same settings");
  }
}

std::string rank_named(int rank) { return "rank " + std::to_string(rank); }

// Which member of the ranks `said` names: rank r of `world_size` (any
// while the ranks are not yet agreed: 0, or a node's local rank, -2),
// else -1; `how`: how its secret stands.
int member_saying(const std::string& said, int world_size, SecretStand& how) {
  const int r = secret_difference_of(said, "rank", rank_named(0), &how);
  if (r > 0 && (world_size == 0 || r < world_size)) return r;
  int node = -1, local = -1;
  if (world_size == 0 && std::sscanf(said.c_str(), "node %d local rank %d", &node, &local) == 2 &&
      said == secret_difference("node " + std::to_string(node) + " local rank " + std::to_string(local), rank_named(0),
                                SecretStand::unusable_file)) {
    how = SecretStand::unusable_file;
    return -2;
  }
  return -1;
}

// The first member's part: its check (or that it cannot use its file),
// for the ranks to compare theirs with.
void leave_the_check(const StoreClient& root, const SecretKeys& keys, const std::optional<std::string>& secret) {
  root.set(keys.check, secret ? secret_check(*secret, random_prefix()) : kFirstCannotUseItsFile);
}

// Another rank's part: how its secret stands against rank 0's check, if
// rank 0 left one within 5 s (a torchrun agent's count of starts may
// differ between nodes: then a rank finds none, and compares nothing).
// Throws UsageError, having said so there, where it differs.
void compare_with_the_check(const StoreClient& root, const SecretKeys& keys, const std::string& secret,
                            const std::string& me) {
  if (!root.wait({keys.check}, std::chrono::seconds(5)).empty()) return;
  const std::optional<SecretStand> how = stand_against(secret, root.get(keys.check));
  if (!how) return;
  if (*how == SecretStand::unusable_file) {
    root.add(keys.ended, 1);
    throw UsageError(secret_difference(rank_named(0), rank_named(0), *how) + ": " + secret_advice("rank", *how));
  }
  const std::string why = secret_difference(me, rank_named(0), *how);
  try {
    root.set(keys.differs, why);
    root.add(keys.ended, 1);
  } catch (const std::exception&) {
    // The store went: rank 0 went with it, and has its own line.
  }
  throw UsageError(why + ": " + secret_advice("rank", *how));
}

}  // namespace

void refused_secret(const StoreClient& root, const SecretKeys& keys, int world_size, bool host) {
  if (!root.check({keys.differs})) return;
  const std::string said = root.get(keys.differs);
  SecretStand how = SecretStand::differs;
  if (member_saying(said, world_size, how) == -1) return;
  // The store's host waits (5 s at most) until every rank, the one that
  // said it included, has ended over the word: its store ends with it.
  root.add(keys.ended, 1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (host && root.add(keys.ended, 0) < world_size && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  throw UsageError(said + ": " + secret_advice("rank", how));
}

// The store the workers of this start meet in, and which start of the job
// it is: our launcher's (node 0's) store, under the round's prefix;
// torchrun's agent's, under the prefix of the start the ranks agree on;
// else a store rank 0 hosts.
//
// Note on torchrun's restarts. Each agent counts only the restarts its own
// workers caused (TORCHELASTIC_RESTART_COUNT, pytorch#108158): after one
// node's worker fails, the other nodes' workers start again with the old
// count, and a prefix made of it would put the ranks of one start in two
// rooms. The agent's store outlives the starts, so each rank counts its own
// starts there: every start of the job starts every rank once, so the
// counts agree, and name the start.
JobStore open_job_store(const WorkerEnv& env, std::chrono::milliseconds timeout) {
  const bool host = !env.ours() && !env.agent_store && env.rank == 0;
  // The job's own keys live under a prefix nobody else can name (store.hpp,
  // "Note on neighbours"): our launcher's, or one derived from the secret,
  // read first: a bad secret file ends every rank at once, not only the
  // store's host while the others wait for it, and a rank whose file alone
  // fails tells the others.
  // The ranks then compare their secrets (comm/secrets.hpp), rank 0's
  // check first, each start's words apart where the store outlives starts.
  const SecretKeys keys(env.agent_store ? env.restart : 0);
  const std::string me = env.rank >= 0 ? rank_named(env.rank)
                                       : "node " + std::to_string(env.node_rank) + " local rank " +
                                             std::to_string(env.local_rank);
  std::optional<std::string> secret = std::string();
  std::exception_ptr unusable;
  try {
    if (!env.ours()) secret = env.secret.read();
  } catch (const UsageError&) {
    secret.reset();
    unusable = std::current_exception();
    if (env.rank != 0) {
      tell_the_first(env.master_addr, env.master_port, keys,
                     secret_difference(me, rank_named(0), SecretStand::unusable_file));
      throw;
    }
  }
  StorePtr store;
  try {
    store = open_store(env.master_addr, env.master_port, host, timeout);
  } catch (const PortInUse&) {
    if (unusable) std::rethrow_exception(unusable);
    throw std::runtime_error("MASTER_PORT " + std::to_string(env.master_port) + " is already in use on " +
                             env.master_addr + ": export MASTER_PORT with a free port for this job");
  }
  if (!env.ours() && env.rank >= 0 && env.world_size > 1) {
    const StoreClient root(store, timeout, "the store at " + env.master_addr + ":" + std::to_string(env.master_port));
    if (env.rank > 0) {
      compare_with_the_check(root, keys, *secret, me);
    } else {
      leave_the_check(root, keys, secret);
      // Rank 0 cannot use its file: its store (if it hosts it) stays up
      // until every other rank has read so, 5 s at most.
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (unusable && root.add(keys.ended, 0) < env.world_size - 1 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  if (unusable) std::rethrow_exception(unusable);
  const std::string prefix = env.ours() ? env.store_prefix : secret->empty() ? "" : prefix_for_secret(*secret);
  auto under = [&](const std::string& name) -> StorePtr {
    return c10::make_intrusive<c10d::PrefixStore>(prefix.empty() ? name : prefix + "/" + name, store);
  };
  if (env.ours()) return {under("round/" + std::to_string(env.round)), store, env.round, host, keys};
  if (!env.agent_store) return {prefix.empty() ? store : under("job"), store, env.restart, host, keys};
  const StoreClient client(store, timeout,
                           "torchrun's store at " + env.master_addr + ":" + std::to_string(env.master_port));
  const std::string starts = (prefix.empty() ? "" : prefix + "/") + "mnist_ddp/starts/rank_" + std::to_string(env.rank);
  const int start = static_cast<int>(client.add(starts, 1)) - 1;
  return {under("/worker/attempt_" + std::to_string(start)), store, start, host, keys};
}

// This rank's place among the nodes' workers when the launcher left it open:
// each node's local rank 0 claims its node rank and announces its worker
// count; node 0's ranks come first. Returns (rank, world size).
RankPlan agree_on_ranks(const StoreClient& store, const WorkerEnv& env, std::chrono::milliseconds timeout,
                        const std::function<void()>& check) {
  const std::string me = "nodes/" + std::to_string(env.node_rank);
  if (env.local_rank == 0) {
    const std::string mine = this_launchers_claim(), key = me + "/claim";
    std::string held = store.compare_set(key, "", mine);
    // Garbage a neighbour left there is no claim: replaced, unless it changes meanwhile.
    if (held != mine && held.rfind(kClaim, 0) != 0) held = store.compare_set(key, held, mine);
    if (held != mine && held.rfind(kClaim, 0) == 0)
      throw std::runtime_error("another node (the launcher with " + held.substr(kClaim.size()) +
                               ") also started with --node-rank " + std::to_string(env.node_rank) +
                               "; give each node its own");
    if (held != mine) throw foreign_value(store, key, held);
    store.set(me + "/nnodes", std::to_string(env.nnodes));
    store.set(me + "/size", std::to_string(env.local_world_size));
  }
  std::vector<std::string> keys;
  for (int k = 0; k < env.nnodes; ++k) keys.push_back("nodes/" + std::to_string(k) + "/size");
  // A node started with another node count would wait for nodes that never
  // come, or leave one out: named as soon as its count is seen.
  auto same_node_count = [&] {
    if (check) check();
    for (int k = 0; k < env.nnodes; ++k) {
      const std::string key = "nodes/" + std::to_string(k) + "/nnodes";
      if (k == env.node_rank || !store.check({key})) continue;
      const std::string text = store.get(key);
      char* end = nullptr;
      const long n = std::strtol(text.c_str(), &end, 10);
      if (text.empty() || *end || n < 1 || n > (1 << 20)) throw foreign_value(store, key, text);
      if (n != env.nnodes)
        throw UsageError("the nodes disagree on the job's size: node " + std::to_string(env.node_rank) +
                         " was started with --nnodes " + std::to_string(env.nnodes) + ", node " + std::to_string(k) +
                         " with --nnodes " + std::to_string(n) + "; give every node the same");
    }
  };
  wait_for(
      store, keys, timeout,
      [&](const std::vector<std::string>& missing) {
        return "node " + numbers_in(missing) + " of " + std::to_string(env.nnodes) + " never joined within " +
               std::to_string(timeout.count() / 1000) + " s: start mnist_ddp there with --nnodes " +
               std::to_string(env.nnodes) + " --node-rank <its rank> --master-addr " + env.master_addr +
               " --master-port " + std::to_string(env.master_port);
      },
      same_node_count);
  RankPlan plan;
  int first = 0;  // this node's first rank
  for (int k = 0; k < env.nnodes; ++k) {
    const std::string text = store.get(keys[k]);
    char* end = nullptr;
    const long size = std::strtol(text.c_str(), &end, 10);
    if (text.empty() || *end || size < 1 || size > (1 << 20)) throw foreign_value(store, keys[k], text);
    if (k < env.node_rank) first += static_cast<int>(size);
    plan.node_of_rank.insert(plan.node_of_rank.end(), static_cast<size_t>(size), k);
  }
  // This node's count is the one its launcher gave its workers, whoever wrote the key.
  const auto mine = std::count(plan.node_of_rank.begin(), plan.node_of_rank.end(), env.node_rank);
  if (mine != env.local_world_size) throw foreign_value(store, me + "/size", store.get(me + "/size"));
  plan.rank = first + env.local_rank;
  plan.world_size = static_cast<int>(plan.node_of_rank.size());
  return plan;
}

// Rank 0 checks everyone's settings, everyone checks rank 0's.
void check_settings(const StoreClient& store, int rank, int world_size, const Settings& settings,
                    std::chrono::milliseconds timeout, const std::function<void()>& check) {
  std::string mine;
  for (const auto& [name, value] : settings) mine += name + "=" + value + "\n";
  store.set("settings/" + std::to_string(rank), mine);
  auto never_arrived = [&](const std::vector<std::string>& missing) {
    return "rank " + numbers_in(missing) + " of " + std::to_string(world_size) + " never arrived within " +
           std::to_string(timeout.count() / 1000) + " s";
  };
  if (rank == 0) {
    for (int r = 1; r < world_size; ++r) {
      const std::string key = "settings/" + std::to_string(r);
      wait_for(store, {key}, timeout, never_arrived, check);
      compare_settings(mine, 0, store.get(key), r);
    }
    store.set("settings/checked", "1");
  } else {
    wait_for(store, {"settings/0"}, timeout, never_arrived, check);
    compare_settings(store.get("settings/0"), 0, mine, rank);
    // Rank 0 has seen every rank, or this one waits with it for the one missing.
    wait_for(store, {"settings/checked"}, timeout, never_arrived, check);
  }
}

std::optional<WorkerEnv> pod_worker(const Environment& environment) {
  const auto decided = node_decisions(environment);  // throws for a launcher we do not know
  if (decided.empty()) return std::nullopt;
  WorkerEnv w;
  w.launcher = "kubeflow";
  w.master_addr = "127.0.0.1";
  for (const auto& [name, value] : decided) {
    if (name == "nnodes") w.world_size = w.nnodes = std::stoi(value);
    if (name == "node_rank") w.rank = w.node_rank = std::stoi(value);
    if (name == "master_addr") w.master_addr = value;
    if (name == "master_port") w.master_port = std::stoi(value);
    if (name == "nproc" && value != "1")
      throw UsageError("environment: PET_NPROC_PER_NODE=" + value + " asks for " + value +
                       " processes in this pod, and a program does not start its own: run it under torchrun, or "
                       "mnist_ddp run --nproc " + value + " -- PROGRAM ARGS");
  }
  if (w.rank >= w.world_size)
    throw UsageError("environment: PET_NODE_RANK=" + std::to_string(w.rank) + " is not below PET_NNODES=" +
                     std::to_string(w.world_size));
  if (w.master_port <= 0)
    throw UsageError("environment: a Kubeflow pod of several nodes needs PET_MASTER_PORT (or MASTER_PORT)");
  return w;
}

}  // namespace mnist_ddp
