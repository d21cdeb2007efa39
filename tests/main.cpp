// The test binary's main: gtest's, ending as mnist_ddp's does
// (end_process, app/base/logging.hpp): without LibTorch's static
// destructors, 0.3 s of each exit. This binary is started some hundreds of
// times a run of the suite: a ctest test each, a process per rank of each
// program the tests launch.
#include <gtest/gtest.h>

#include "app/base/logging.hpp"

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  mnist_ddp::end_process(RUN_ALL_TESTS());
}
