// The restart protocol on its own: launchers as threads over one in-memory
// store, as the training code's ranks are.
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <future>
#include <thread>

#include "app/launch/restart_rounds.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;

bool pause_briefly() {
  std::this_thread::sleep_for(5ms);
  return false;
}

TEST(RestartRounds, ASingleNodeRestartsAtOnceForItsOwnCause) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  RestartRounds rounds(store, 0, 1, 1s);
  EXPECT_FALSE(rounds.requested(1));
  const auto outcome = rounds.join(1, "worker rank 1 exited with status 1", [] { return true; });
  EXPECT_TRUE(outcome.start);
  EXPECT_EQ(outcome.why, "worker rank 1 exited with status 1");
}

// The node that loses a worker asks; the other sees the request, stops its
// workers, and joins: both restart for the first cause.
TEST(RestartRounds, EveryNodeJoinsTheFirstRequestAndRestartsForItsCause) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  RestartRounds node0(store, 0, 2, 10s), node1(store, 1, 2, 10s);
  auto asked = std::async(std::launch::async, [&] { return node1.join(1, "worker local rank 0 died", pause_briefly); });
  std::optional<std::string> request;
  for (int i = 0; i < 1000 && !request; ++i) {
    request = node0.requested(1);
    std::this_thread::sleep_for(2ms);
  }
  ASSERT_TRUE(request);
  EXPECT_EQ(*request, "node 1: worker local rank 0 died");
  EXPECT_FALSE(node0.requested(2)) << "nobody asked for round 2";
  const auto joined = node0.join(1, "lost rank 2", pause_briefly);
  const auto first = asked.get();
  EXPECT_TRUE(joined.start);
  EXPECT_TRUE(first.start);
  EXPECT_EQ(joined.why, "node 1: worker local rank 0 died");
  EXPECT_EQ(first.why, joined.why);
}

TEST(RestartRounds, ANodeThatRefusesStopsTheRound) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  RestartRounds node0(store, 0, 2, 10s), node1(store, 1, 2, 10s);
  node0.refuse(1, "node 0 stopped (interrupted)");
  const auto outcome = node1.join(1, "worker died", pause_briefly);
  EXPECT_FALSE(outcome.start);
  EXPECT_EQ(outcome.why, "node 0 stopped (interrupted)");
}

TEST(RestartRounds, ANodeThatNeverComesIsNamedAfterTheTimeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  RestartRounds node1(store, 1, 3, 1s);
  const auto start = std::chrono::steady_clock::now();
  const auto outcome = node1.join(1, "worker died", pause_briefly);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 1s);
  EXPECT_FALSE(outcome.start);
  EXPECT_EQ(outcome.why, "node 0, 2 did not join restart 1 within 1 s (after node 1: worker died)");
}

// What another process writes at the round's keys is no node's word: a
// cause that no node set asks for nothing and is replaced, a node that
// is not "ready" is not ready, a refusal no node made refuses nothing.
TEST(RestartRounds, WhatNoNodeWroteIsIgnored) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->set("restart/1/cause", std::vector<uint8_t>{'x', 0x1b, 'y'});
  store->add("restart/1/node/1", 1);
  store->set("restart/1/refused", std::vector<uint8_t>{'n', 'o', 'p', 'e'});
  RestartRounds node0(store, 0, 2, 1s), node1(store, 1, 2, 1s);
  EXPECT_FALSE(node1.requested(1)) << "a cause no node set";
  const auto outcome = node0.join(1, "worker died", pause_briefly);
  EXPECT_FALSE(outcome.start);
  EXPECT_EQ(outcome.why, "node 1 did not join restart 1 within 1 s (after node 0: worker died)");
  ASSERT_TRUE(node1.requested(1));
  EXPECT_EQ(*node1.requested(1), "node 0: worker died");
  // A node's cause, refusal and readiness are printable whatever was written.
  store->set("restart/2/cause", std::vector<uint8_t>{'n', 'o', 'd', 'e', ' ', '1', ':', ' ', 0x1b, '[', '2', 'J'});
  EXPECT_EQ(*node0.requested(2), "node 1: ?[2J");
}

TEST(RestartRounds, AnInterruptionEndsTheWaitWithoutACause) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  RestartRounds node0(store, 0, 2, 60s);
  const auto start = std::chrono::steady_clock::now();
  const auto outcome = node0.join(1, "worker died", [] { return true; });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_FALSE(outcome.start);
  EXPECT_EQ(outcome.why, "");
}

}  // namespace
}  // namespace mnist_ddp
