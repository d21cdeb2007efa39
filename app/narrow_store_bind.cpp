// Narrows the rendezvous store's listening socket to one address.
//
// Why: LibTorch's TCPStore listens on every interface and has no option to
// choose one, but a store reachable from the network lets anyone there join
// or disturb the job, and a single-node run has no reason to be reachable at
// all. This file defines bind() with C linkage, and only the mnist_ddp
// executable links it, exported (CMakeLists.txt:
// --export-dynamic-symbol=bind), so calls to bind() from LibTorch's shared
// libraries land here. While open_store() hosts a store
// (comm/store.hpp, store_bind_address()), a bind to the IPv4 wildcard is
// narrowed to the store host's address (--master-addr, or MASTER_ADDR under
// torchrun and Slurm; loopback for a single-node run) and a bind to the IPv6
// wildcard is refused with EADDRNOTAVAIL, so that the store falls back to
// that IPv4 address. Every other bind, on any thread, and every bind outside
// that window (Gloo's and NCCL's sockets come later) goes to libc's bind()
// unchanged. A store that torchrun's agent hosts is torchrun's own and is
// not narrowed.
#include <dlfcn.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>

#include "comm/store.hpp"

extern "C" int bind(int fd, const sockaddr* addr, socklen_t len) {
  using Bind = int (*)(int, const sockaddr*, socklen_t);
  static const auto real_bind = reinterpret_cast<Bind>(dlsym(RTLD_NEXT, "bind"));
  const in_addr_t narrow = mnist_ddp::store_bind_address().load();
  if (narrow != INADDR_NONE && addr) {
    if (addr->sa_family == AF_INET6 &&
        IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr)) {
      errno = EADDRNOTAVAIL;
      return -1;
    }
    if (addr->sa_family == AF_INET && reinterpret_cast<const sockaddr_in*>(addr)->sin_addr.s_addr == INADDR_ANY) {
      sockaddr_in narrowed = *reinterpret_cast<const sockaddr_in*>(addr);
      narrowed.sin_addr.s_addr = narrow;
      return real_bind(fd, reinterpret_cast<const sockaddr*>(&narrowed), sizeof narrowed);
    }
  }
  return real_bind(fd, addr, len);
}
