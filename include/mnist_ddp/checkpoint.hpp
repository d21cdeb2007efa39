// Files a run leaves behind, written so that a kill at any instant leaves
// either the previous file or the new one, never a torn one.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

namespace mnist_ddp {

// Writes `bytes` to a temporary file beside `path`, flushes it to disk and
// renames it over `path`. Throws std::runtime_error naming the file.
void write_file_atomically(const std::string& path, const std::vector<char>& bytes);

// The module's state as Python's Module.state_dict() lists it: each
// module's parameters, then its buffers, then its children, depth first;
// names joined with '.'. Tensors are detached CPU copies.
c10::Dict<std::string, torch::Tensor> state_dict(const torch::nn::Module& module);

// Saves a state dict in the format of Python's torch.save, so that
// torch.load(path) returns a dict of tensors.
void save_state_dict(const std::string& path, const c10::Dict<std::string, torch::Tensor>& state);

}  // namespace mnist_ddp
