#include "mnist_ddp/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <torch/csrc/jit/serialization/pickle.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace mnist_ddp {
namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw std::runtime_error("cannot write " + path + ": " + what + ": " + std::strerror(errno));
}

void add_state(const torch::nn::Module& module, const std::string& prefix, c10::Dict<std::string, torch::Tensor>& out) {
  for (const auto& p : module.named_parameters(/*recurse=*/false))
    out.insert(prefix + p.key(), p.value().detach().to(torch::kCPU).clone());
  for (const auto& b : module.named_buffers(/*recurse=*/false))
    out.insert(prefix + b.key(), b.value().detach().to(torch::kCPU).clone());
  for (const auto& child : module.named_children()) add_state(*child.value(), prefix + child.key() + ".", out);
}

}  // namespace

void write_file_atomically(const std::string& path, const std::vector<char>& bytes) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("open", tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      close(fd);
      unlink(tmp.c_str());
      fail("write", tmp);
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0 || close(fd) != 0) {
    unlink(tmp.c_str());
    fail("fsync", tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    unlink(tmp.c_str());
    fail("rename", path);
  }
}

c10::Dict<std::string, torch::Tensor> state_dict(const torch::nn::Module& module) {
  c10::Dict<std::string, torch::Tensor> out;
  add_state(module, "", out);
  return out;
}

void save_state_dict(const std::string& path, const c10::Dict<std::string, torch::Tensor>& state) {
  write_file_atomically(path, torch::jit::pickle_save(c10::IValue(state)));
}

}  // namespace mnist_ddp
