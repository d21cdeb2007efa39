// The rendezvous against a hostile neighbour on the store: a store hosted
// in this process on loopback, the neighbour a socket of this process, each
// test bounding its own time and connections.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "mnist_ddp/comm/process_group.hpp"
#include "comm/store.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;

using test::connect_to_port;

// Node 0's only worker in round `round` of our launcher's job at `port`.
WorkerEnv worker_at(int port, int round) {
  WorkerEnv env;
  env.launcher = "mnist_ddp";
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  env.round = round;
  return env;
}

ProcessGroup join(int port, int round, std::chrono::milliseconds timeout) {
  return init_process_group(worker_at(port, round), ProcessGroupOptions()
                                                     .backend("gloo")
                                                     .device(torch::Device(torch::kCPU))
                                                     .timeout(timeout)
                                                     .settings({{"epochs", "1"}}));
}

// One local process sent the first bytes of a request and nothing more:
// the classic store waits for the rest, serving nobody. The join ends
// within its timeout, naming the store, instead of when the sender leaves.
// libuv's loop (PyTorch's own builds of 2.x) serves the others meanwhile,
// and the join goes through.
TEST(Rendezvous, APartialRequestOnTheStoreEndsTheJoinWithinItsTimeout) {
  auto store = open_store("127.0.0.1", 0, /*host=*/true, 10s);
  const int port = static_cast<int>(store->getPort());
  const int neighbour = connect_to_port(port);
  ASSERT_GE(neighbour, 0);
  const char partial[] = {0x00, 0x05, 0x00};  // a SET, and part of its key's length
  ASSERT_EQ(write(neighbour, partial, sizeof partial), static_cast<ssize_t>(sizeof partial));
  std::this_thread::sleep_for(200ms);  // the store has begun to read it
  const auto start = std::chrono::steady_clock::now();
  try {
    join(port, 0, 2s);
    EXPECT_EQ(store_kind(), "libuv") << "joined a stalled store";
  } catch (const StoreStalled& e) {
    EXPECT_EQ(store_kind(), "classic") << "libuv's loop stalled on one client: " << e.what();
    // LibTorch 2.x's client asks the server at once: stalled while connecting.
    const std::string what = e.what();
    EXPECT_NE(what.find("the rendezvous store at 127.0.0.1:" + std::to_string(port)), std::string::npos) << what;
    EXPECT_NE(what.find(" within 2 s"), std::string::npos) << what;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  close(neighbour);  // the store serves again, and can be closed
  EXPECT_NO_THROW(join(port, 1, 10s));
  close_store(store);
}

// 1,100 idle connections under the common soft limit of 1024 descriptors:
// the store (which needs one each) has the hard limit, and the job joins.
TEST(Rendezvous, ManyIdleConnectionsDoNotStopTheStore) {
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  if (saved.rlim_max < 2 * 1100 + 200) GTEST_SKIP() << "the hard limit of open files is " << saved.rlim_max;
  rlimit common = saved;
  common.rlim_cur = 1024;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &common), 0);
  auto store = open_store("127.0.0.1", 0, /*host=*/true, 10s);
  const int port = static_cast<int>(store->getPort());
  std::vector<int> idle;
  for (int i = 0; i < 1100; ++i) {
    const int fd = connect_to_port(port);
    if (fd < 0) break;
    idle.push_back(fd);
  }
  EXPECT_EQ(idle.size(), 1100u);
  EXPECT_NO_THROW(join(port, 0, 10s));
  for (int fd : idle) close(fd);
  close_store(store);
  setrlimit(RLIMIT_NOFILE, &saved);
}

// What another process writes into the job's keys does not break a
// (re)start: a count added at the key older versions claimed a node with,
// garbage at the one claimed now.
TEST(Rendezvous, AValueNoNodeWroteDoesNotBreakTheJoin) {
  auto store = open_store("127.0.0.1", 0, /*host=*/true, 10s);
  const int port = static_cast<int>(store->getPort());
  store->add("round/1/nodes/0/claims", 1);
  store->set("round/1/nodes/0/claim", std::vector<uint8_t>{'h', 'i'});
  const ProcessGroup group = join(port, 1, 10s);
  EXPECT_EQ(group.rank(), 0);
  EXPECT_EQ(group.world_size(), 1);
  // A node count no launcher wrote is named, not parsed into nonsense.
  store->set("round/2/nodes/1/size", std::vector<uint8_t>{'x'});
  WorkerEnv two = worker_at(port, 2);
  two.nnodes = 2;
  try {
    init_process_group(two, ProcessGroupOptions().backend("gloo").device(torch::Device(torch::kCPU)).timeout(10s));
    ADD_FAILURE() << "joined with a foreign node count";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("holds 'x' at nodes/1/size, which no mnist_ddp wrote"), std::string::npos)
        << e.what();
  }
  close_store(store);
}

}  // namespace
}  // namespace mnist_ddp
