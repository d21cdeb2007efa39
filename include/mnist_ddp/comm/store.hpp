// The job's rendezvous store: a c10d TCPStore, hosted by node 0's launcher
// (ours), by torchrun's agent when it says so, else by rank 0.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mnist_ddp {

using StorePtr = c10::intrusive_ptr<c10d::Store>;

// The store could not be hosted: its port is taken on this machine.
struct PortInUse : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Hosts the job's TCPStore at addr:port (port 0: a free one), or, unless
// `host`, reaches it within `timeout`. Throws PortInUse, or
// std::runtime_error with a one-line reason (address that does not resolve,
// store unreachable).
c10::intrusive_ptr<c10d::TCPStore> open_store(const std::string& addr, int port, bool host,
                                              std::chrono::milliseconds timeout);

// The store's server loop in this process: "libuv" where LibTorch has it
// (2.x built with libuv), else "classic" (1.13, and Debian 13's 2.6).
std::string store_kind();

// Note on the store's address. LibTorch's TCPStore listens on every
// interface and has no option to choose one. While open_store() hosts a
// store, this holds the IPv4 address (network byte order) that the store's
// listening socket should be narrowed to; 0xffffffff (INADDR_NONE) outside
// that window. The mnist_ddp executable's bind() reads it
// (src/narrow_store_bind.cpp); a program without that file listens as
// LibTorch does.
std::atomic<uint32_t>& store_bind_address();

// A store value as text, and text as a store value.
std::vector<uint8_t> bytes_of(const std::string& s);
std::string text_of(const std::vector<uint8_t>& b);

}  // namespace mnist_ddp
