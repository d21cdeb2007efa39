// The test binary's main: gtest's, but the process ends without LibTorch's
// static destructors, as mnist_ddp's does (app/main.cpp). They deregister
// every operator, 0.3 s of each exit, and this binary is started some
// hundreds of times a run of the suite: a ctest test each, a process per
// rank of each program the tests launch.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  const int code = RUN_ALL_TESTS();
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::_Exit(code);
}
