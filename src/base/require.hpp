// MNIST_DDP_REQUIRE(condition, parts...): a UsageError whose line is the
// parts written one after another (as TORCH_CHECK writes them), where a
// program gave the library what it cannot take. Not installed.
#pragma once

#include <c10/util/StringUtil.h>

#include "mnist_ddp/base/errors.hpp"

#define MNIST_DDP_REQUIRE(condition, ...)                                       \
  do {                                                                          \
    if (!(condition)) throw ::mnist_ddp::UsageError(::c10::str(__VA_ARGS__));  \
  } while (0)
