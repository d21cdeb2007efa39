// Paths and directories through POSIX calls.
//
// Why not std::filesystem: LibTorch 2.x's libtorch.so exports its own copy of
// std::filesystem's symbols, built by another compiler, and code linked
// against it may call that copy with this compiler's object layout (a crash
// in remove_all was seen). Nothing in mnist_ddp calls std::filesystem.
#pragma once

#include <string>
#include <vector>

namespace mnist_ddp::files {

// `dir` + "/" + `name`, without doubling a trailing slash.
std::string join(const std::string& dir, const std::string& name);

bool exists(const std::string& path);
bool is_directory(const std::string& path);

// Creates `path` and any missing parents. Throws std::runtime_error naming
// the directory that could not be created and why.
void make_directories(const std::string& path);

// Makes the run's directory `path` (--path) and any missing parents, and
// checks that this process may write there. Throws std::runtime_error
// "--path <path>: <why>".
void make_run_directory(const std::string& path);

// The names in `dir`, without "." and "..", in no particular order; empty
// when it cannot be read.
std::vector<std::string> list_directory(const std::string& dir);

// Removes a file; a missing one is not an error.
void remove_file(const std::string& path);

// Removes `path` and everything under it, as far as it can; never throws.
void remove_tree(const std::string& path);

}  // namespace mnist_ddp::files
