#include "mnist_ddp/comm/store.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "mnist_ddp/base/errors.hpp"
#include "mnist_ddp/base/port.hpp"

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

}  // namespace

std::atomic<uint32_t>& store_bind_address() {
  static std::atomic<uint32_t> address{INADDR_NONE};
  return address;
}

c10::intrusive_ptr<c10d::TCPStore> open_store(const std::string& addr, int port, bool host,
                                              std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(port);
  so.isServer = host;
  so.waitWorkers = false;  // the world size may not be known yet; the rendezvous waits for the ranks
  so.timeout = timeout;
  port::set_store_libuv(so, libuv_available());
  const in_addr_t address = host ? ipv4_address(addr) : INADDR_NONE;
  try {
    store_bind_address() = address;
    auto store = c10::make_intrusive<c10d::TCPStore>(addr, so);
    store_bind_address() = INADDR_NONE;
    return store;
  } catch (const std::exception& e) {
    store_bind_address() = INADDR_NONE;
    const std::string why = error_line(e);
    if (host) {
      if (port_in_use(address, port))
        throw PortInUse("--master-port " + std::to_string(port) +
                        " is already in use on this machine; choose another port or 0 for a free one");
      throw std::runtime_error("cannot host the rendezvous store at " + addr + ":" + std::to_string(port) + ": " + why);
    }
    throw std::runtime_error("could not reach the rendezvous store at " + addr + ":" + std::to_string(port) +
                             " within " + std::to_string(timeout.count() / 1000) + " s (" + why + ")");
  }
}

std::string store_kind() { return libuv_available() ? "libuv" : "classic"; }

std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
std::string text_of(const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); }

}  // namespace mnist_ddp
