#include "comm/store.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <c10/util/hash.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <exception>
#include <random>

#include "mnist_ddp/base/errors.hpp"
#include "base/port.hpp"

namespace mnist_ddp {
namespace {

// The IPv4 address `host` resolves to.
in_addr_t ipv4_address(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || !res)
    throw std::runtime_error("cannot resolve --master-addr " + host + " to an IPv4 address");
  const in_addr_t address = reinterpret_cast<const sockaddr_in*>(res->ai_addr)->sin_addr.s_addr;
  freeaddrinfo(res);
  return address;
}

// Whether a listening socket at `address`:`port` is refused with EADDRINUSE:
// the kernel's word on why a store could not be hosted there.
bool port_in_use(in_addr_t address, int port) {
  if (port == 0) return false;
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const int on = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_port = htons(static_cast<uint16_t>(port));
  at.sin_addr.s_addr = address;
  const bool in_use = ::bind(fd, reinterpret_cast<const sockaddr*>(&at), sizeof at) != 0 && errno == EADDRINUSE;
  close(fd);
  return in_use;
}

// Whether this LibTorch's TCPStore can run libuv's server loop: where it
// has the option (2.2 on), asked once by hosting a store on loopback, since
// a LibTorch built without libuv (Debian 13's 2.6) refuses one that asks.
bool libuv_available() {
  static const bool available = [] {
    if (!port::kStoreMayUseLibUv) return false;
    c10d::TCPStoreOptions so;
    so.port = 0;
    so.isServer = true;
    so.waitWorkers = false;
    so.timeout = std::chrono::seconds(5);
    port::set_store_libuv(so, true);
    store_bind_address() = htonl(INADDR_LOOPBACK);
    bool works = true;
    try {
      c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
    } catch (const std::exception&) {
      works = false;
    }
    store_bind_address() = INADDR_NONE;
    return works;
  }();
  return available;
}

// Raises the soft limit of open files to the hard one: a store host holds a
// descriptor per connection, and the common soft limit of 1024 is soon
// spent by connections that are not the job's.
void raise_open_file_limit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
  }
}

// What the terminate handler names: the store this process hosts, or last
// reached. Plain characters, as the handler may read them on another thread.
char g_store[160] = "the rendezvous store";
std::atomic<bool> g_said{false};  // say_no_more()

void name_store(const std::string& addr, int port) {
  std::snprintf(g_store, sizeof g_store, "the rendezvous store at %s:%d", addr.c_str(), port);
}

}  // namespace

std::string out_of_descriptors(const std::string& why) {
  rlimit limit{};
  getrlimit(RLIMIT_NOFILE, &limit);
  return std::string(g_store) + " ran out of file descriptors (" + std::to_string(limit.rlim_cur) +
         ", ulimit -n): too many connections to it from other processes; raise the limit or stop them (" + why + ")";
}

bool descriptors_spent() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return false;
  DIR* fds = opendir("/proc/self/fd");
  if (!fds) return errno == EMFILE || errno == ENFILE;
  rlim_t open = 0;
  while (readdir(fds)) ++open;  // with ".", ".." and the listing's own: 3 over
  closedir(fds);
  return open + 8 >= limit.rlim_cur;
}

namespace {

// LibTorch's store lets an error escape a thread of its own: the server's
// loop when it cannot accept a connection (out of descriptors), 1.13's
// client listener when the server's end of the connection goes. One line
// saying so instead of an abort; the workers die with their launcher
// (PR_SET_PDEATHSIG).
[[noreturn]] void one_line_instead_of_abort() {
  if (g_said) _exit(1);
  std::string why = "an unexpected error";
  try {
    if (const std::exception_ptr e = std::current_exception()) std::rethrow_exception(e);
  } catch (const std::exception& e) {
    why = error_line(e);
  } catch (...) {
  }
  if (why.find("Too many open files") != std::string::npos || why.find("errno 24") != std::string::npos ||
      why.find("errno: 24") != std::string::npos)
    why = out_of_descriptors(why);
  else if (why.find("reset by peer") != std::string::npos || why.find("Broken pipe") != std::string::npos)
    why = "lost " + std::string(g_store) + " (its host stopped, or dropped the connection): " + why;
  const std::string line = "mnist_ddp: error: " + why + "\n";
  if (write(STDERR_FILENO, line.data(), line.size()) < 0) {
  }
  _exit(1);
}

}  // namespace

StoreClient::StoreClient(StorePtr store, std::chrono::milliseconds timeout, std::string where)
    : store_(std::move(store)), timeout_(timeout), where_(std::move(where)), stalls_(std::make_shared<Stalls>()) {}

void StoreClient::set(const std::string& key, const std::string& value) const {
  request([store = store_, key, value] { store->set(key, bytes_of(value)); });
}

std::string StoreClient::get(const std::string& key) const {
  return request([store = store_, key] { return text_of(store->get(key)); });
}

int64_t StoreClient::add(const std::string& key, int64_t delta) const {
  return request([store = store_, key, delta] { return store->add(key, delta); });
}

bool StoreClient::check(const std::vector<std::string>& keys) const {
  return request([store = store_, keys] { return store->check(keys); });
}

std::string StoreClient::compare_set(const std::string& key, const std::string& expected,
                                     const std::string& desired) const {
  return request([store = store_, key, expected, desired] {
    return text_of(store->compareSet(key, bytes_of(expected), bytes_of(desired)));
  });
}

std::vector<std::string> StoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds limit) const {
  // Polled rather than the store's own wait: every request is one bounded
  // call, and a stalled store is told from keys that are missing.
  const auto deadline = std::chrono::steady_clock::now() + limit;
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    std::vector<std::string> missing;
    if (!check(keys))
      for (const auto& k : keys)
        if (!check({k})) missing.push_back(k);
    if (missing.empty() || std::chrono::steady_clock::now() >= deadline) return missing;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}

std::atomic<uint32_t>& store_bind_address() {
  static std::atomic<uint32_t> address{INADDR_NONE};
  return address;
}

c10::intrusive_ptr<c10d::TCPStore> open_store(const std::string& addr, int port, bool host,
                                              std::chrono::milliseconds timeout) {
  raise_open_file_limit();
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(port);
  so.isServer = host;
  so.waitWorkers = false;  // the world size may not be known yet; the rendezvous waits for the ranks
  so.timeout = timeout;
  port::set_store_libuv(so, libuv_available());
  const in_addr_t address = host ? ipv4_address(addr) : INADDR_NONE;
  const std::string unreachable = "could not reach the rendezvous store at " + addr + ":" + std::to_string(port) +
                                  " within " + std::to_string(timeout.count() / 1000) + " s";
  // Before the store's threads start: a neighbour may flood it at once.
  name_store(addr, port);
  std::set_terminate(one_line_instead_of_abort);
  try {
    if (!host)  // a client's constructor may ask the server something (2.x): bounded
      return StoreClient::within(timeout + std::chrono::seconds(1), unreachable + " (it did not answer)",
                                 [addr, so] { return c10::make_intrusive<c10d::TCPStore>(addr, so); });
    // The host's constructor asks its own server something too (2.x), and a
    // neighbour that holds the server mid-request stalls it: bounded as well.
    store_bind_address() = address;
    auto store = StoreClient::within(
        timeout + std::chrono::seconds(1),
        "the store did not answer within " + std::to_string(timeout.count() / 1000) +
            " s (--timeout): its host is gone or hung, or a client holds it mid-request",
        [addr, so] { return c10::make_intrusive<c10d::TCPStore>(addr, so); });
    store_bind_address() = INADDR_NONE;
    name_store(addr, static_cast<int>(store->getPort()));
    return store;
  } catch (const StoreStalled&) {
    store_bind_address() = INADDR_NONE;
    throw;
  } catch (const std::exception& e) {
    store_bind_address() = INADDR_NONE;
    const std::string why = error_line(e);
    if (host) {
      if (port_in_use(address, port))
        throw PortInUse("--master-port " + std::to_string(port) +
                        " is already in use on this machine; choose another port or 0 for a free one");
      throw std::runtime_error("cannot host the rendezvous store at " + addr + ":" + std::to_string(port) + ": " + why);
    }
    throw std::runtime_error(unreachable + " (" + why + ")");
  }
}

void say_no_more() { g_said = true; }

void close_store(c10::intrusive_ptr<c10d::TCPStore>& store) {
  if (!store) return;
  auto closed = std::make_shared<std::promise<void>>();
  auto done = closed->get_future();
  std::thread([store = std::move(store), closed]() mutable {
    store.reset();
    closed->set_value();
  }).detach();
  done.wait_for(std::chrono::seconds(1));
}

void leave_word(const std::string& addr, int port, const std::function<void(const StoreClient&)>& say) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  do {
    try {
      auto store = open_store(addr, port, false, std::chrono::seconds(1));
      say(StoreClient(store, std::chrono::seconds(2), "the store at " + addr + ":" + std::to_string(port)));
      close_store(store);
      return;
    } catch (const std::exception&) {
    }
  } while (std::chrono::steady_clock::now() < deadline);
}

std::string store_kind() { return libuv_available() ? "libuv" : "classic"; }

std::string prefix_for_secret(const std::string& secret) {
  return "job-" + c10::sha1("mnist_ddp store prefix\n" + secret).str().substr(0, 32);
}

std::string random_prefix() {
  std::random_device device;  // /dev/urandom
  char text[40];
  std::snprintf(text, sizeof text, "job-%08x%08x%08x%08x", device(), device(), device(), device());
  return text;
}

std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
std::string text_of(const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); }

}  // namespace mnist_ddp
