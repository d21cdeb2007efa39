// The job's rendezvous store: a c10d TCPStore, hosted by node 0's launcher
// (ours), by torchrun's agent when it says so, else by rank 0. Private to
// the library and its application.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "mnist_ddp/base/errors.hpp"

namespace mnist_ddp {

using StorePtr = c10::intrusive_ptr<c10d::Store>;

// The store could not be hosted: its port is taken on this machine.
struct PortInUse : Error {
  using Error::Error;
};

// A store request that got no answer in time (see "Note on stalls").
struct StoreStalled : Timeout {
  using Timeout::Timeout;
};

// Hosts the job's TCPStore at addr:port (port 0: a free one), or, unless
// `host`, reaches it within `timeout`. First raises this process's limit of
// open files to its hard limit (every worker inherits it), so that many
// connections to the store do not exhaust it; a host that runs out all the
// same ends with one line naming the store, not an abort. Throws
// PortInUse, StoreStalled, or std::runtime_error with a one-line reason
// (address that does not resolve, store unreachable).
c10::intrusive_ptr<c10d::TCPStore> open_store(const std::string& addr, int port, bool host,
                                              std::chrono::milliseconds timeout);

// For a process that has said why it ends: an error that escapes one of
// LibTorch's store threads from now on (open_store() makes such an error
// one line and exit 1, never an abort) ends it without another line.
void say_no_more();

// Lets go of a store this process opened, without waiting more than a
// second for it: LibTorch's server joins its loop on destruction, which a
// client holding a request open keeps busy for ever. What it could not
// finish ends with the process.
void close_store(c10::intrusive_ptr<c10d::TCPStore>& store);

class StoreClient;
// For a process that ends before its job meets: reaches the store at
// addr:port as a client and has `say` leave its word there, if the store
// answers within 5 s (the processes of a job start together), so that the
// others end at once rather than wait --timeout for it. Gives up silently
// otherwise.
void leave_word(const std::string& addr, int port, const std::function<void(const StoreClient&)>& say);

// Note on stalls. LibTorch's TCPStore server (1.13's, and 2.x's classic
// one) serves one request at a time and waits without limit for the rest of
// a request it has begun to read, so one local process that sends part of
// a request stops it for every client; and a client's own timeout covers
// only some of its requests. So our own requests go through a StoreClient:
// each runs on a helper thread, and is given up after the client's timeout
// with StoreStalled naming the store. A request given up stays blocked on
// its thread until the store answers or the process ends; until then the
// client counts the store as stalled and refuses every request at once, so
// threads never pile up. Training itself never waits on the store.
class StoreClient {
 public:
  // `where` names the store in errors: "the rendezvous store at host:port".
  StoreClient(StorePtr store, std::chrono::milliseconds timeout, std::string where);

  void set(const std::string& key, const std::string& value) const;
  std::string get(const std::string& key) const;  // the key must be set
  int64_t add(const std::string& key, int64_t delta) const;
  bool check(const std::vector<std::string>& keys) const;
  // Sets `key` to `desired` if it holds `expected` ("" : if unset); returns
  // what it holds afterwards.
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) const;
  // Waits up to `limit` for every key; returns those still missing.
  std::vector<std::string> wait(const std::vector<std::string>& keys, std::chrono::milliseconds limit) const;

  const StorePtr& store() const { return store_; }
  const std::string& where() const { return where_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // Runs `work` (which may block on the store) on a helper thread for up
  // to `limit`; StoreStalled saying `what` after that. `work` must own
  // what it uses: it may outlive the call.
  template <typename Work>
  static auto within(std::chrono::milliseconds limit, const std::string& what, Work work) -> decltype(work());

 private:
  struct Stalls;
  template <typename Work>
  auto request(Work work) const -> decltype(work());

  StorePtr store_;
  std::chrono::milliseconds timeout_;
  std::string where_;
  std::shared_ptr<Stalls> stalls_;
};

// Whether this process holds (nearly) every file descriptor its soft limit
// allows. A store host there takes no more clients: 1.13's and the classic
// server loop end (one line, `out_of_descriptors`), libuv's closes each
// client as it comes, so its workers only time out.
bool descriptors_spent();
// "<the store> ran out of file descriptors (N, ulimit -n): ... (<why>)".
std::string out_of_descriptors(const std::string& why);

// The store's server loop in this process: "libuv" where LibTorch has it
// (2.x built with libuv), else "classic" (1.13, and Debian 13's 2.6).
std::string store_kind();

// Note on the store's address. LibTorch's TCPStore listens on every
// interface and has no option to choose one. While open_store() hosts a
// store, this holds the IPv4 address (network byte order) that the store's
// listening socket should be narrowed to; 0xffffffff (INADDR_NONE) outside
// that window. The mnist_ddp executable's bind() reads it
// (app/narrow_store_bind.cpp); a program without that file listens as
// LibTorch does.
std::atomic<uint32_t>& store_bind_address();

// Note on neighbours. LibTorch's TCPStore has no authentication: any
// process that reaches its port can read and write any key it can name. So
// a job keeps every key of its own under a prefix no such process can
// guess: our launcher draws 128 random bits for a job on one node and hands
// them to its workers (WorkerEnv::store_prefix); nodes of one job derive it
// from a secret the user gives them all (MNIST_DDP_SECRET or
// MNIST_DDP_SECRET_FILE, docs/clusters.md), and so does a rank 0 that hosts
// the store for another launcher. Without a secret, a job across nodes (or
// under another launcher) keeps its keys where anyone can name them, as
// PyTorch's jobs do. Whatever the prefix, what is read is checked for what
// it may be, and a foreign value is named, never obeyed.

// The prefix of a job whose nodes share `secret`: a SHA-1 of it, so the
// store never sees the secret itself.
std::string prefix_for_secret(const std::string& secret);
// A prefix nobody can guess: 128 random bits, in hex.
std::string random_prefix();

// A store value as text, and text as a store value.
std::vector<uint8_t> bytes_of(const std::string& s);
std::string text_of(const std::vector<uint8_t>& b);

// ---- implementation of the templates above ----

struct StoreClient::Stalls {
  std::mutex mutex;
  int given_up = 0;  // requests still blocked after their caller gave up on them
};

template <typename Work>
auto StoreClient::within(std::chrono::milliseconds limit, const std::string& what, Work work) -> decltype(work()) {
  using Result = decltype(work());
  auto task = std::make_shared<std::packaged_task<Result()>>(std::move(work));
  auto done = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (done.wait_for(limit) != std::future_status::ready) throw StoreStalled(what);
  return done.get();
}

template <typename Work>
auto StoreClient::request(Work work) const -> decltype(work()) {
  using Result = decltype(work());
  const std::string stalled = where_ + " did not answer within " + std::to_string(timeout_.count() / 1000) +
                              " s (--timeout): its host is gone or hung, or a client holds it mid-request";
  auto stalls = stalls_;
  {
    std::lock_guard<std::mutex> lock(stalls->mutex);
    if (stalls->given_up > 0) throw StoreStalled(stalled);
  }
  struct Call {
    std::promise<Result> result;
    bool given_up = false;
  };
  auto call = std::make_shared<Call>();
  auto answer = call->result.get_future();
  std::thread([call, stalls, work = std::move(work)]() mutable {
    try {
      if constexpr (std::is_void_v<Result>) {
        work();
        call->result.set_value();
      } else {
        call->result.set_value(work());
      }
    } catch (...) {
      call->result.set_exception(std::current_exception());
    }
    std::lock_guard<std::mutex> lock(stalls->mutex);
    if (call->given_up) --stalls->given_up;
  }).detach();
  if (answer.wait_for(timeout_) != std::future_status::ready) {
    std::lock_guard<std::mutex> lock(stalls->mutex);
    if (answer.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      call->given_up = true;
      ++stalls->given_up;
      throw StoreStalled(stalled);
    }
  }
  return answer.get();
}

}  // namespace mnist_ddp
