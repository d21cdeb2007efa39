# GoogleTest, compiled here from its sources with LibTorch's flags
# (TORCH_CXX_FLAGS, which set _GLIBCXX_USE_CXX11_ABI): the tests then link
# with a LibTorch of either C++ ABI, where a prebuilt libgtest.a has one
# fixed (pip wheels up to 2.6 and the "pre-cxx11" archives use the old one).
#
# The sources: MNIST_DDP_GTEST_SOURCE_DIR, else src/googletest under each
# CMAKE_PREFIX_PATH entry and /usr (Debian's googletest package). Without
# them the tests are left out, and configuring says so. Defines
# GTest::gtest (tests/main.cpp is the tests' main).

set(gtest_candidates "")
string(REPLACE ":" ";" env_prefixes "$ENV{CMAKE_PREFIX_PATH}")
foreach(prefix IN LISTS CMAKE_PREFIX_PATH env_prefixes)
  list(APPEND gtest_candidates "${prefix}/src/googletest")
endforeach()
find_path(MNIST_DDP_GTEST_SOURCE_DIR googletest/include/gtest/gtest.h
  PATHS ${gtest_candidates} /usr/src/googletest NO_DEFAULT_PATH
  DOC "GoogleTest's sources (the directory holding googletest/), built with LibTorch's flags")
if(NOT MNIST_DDP_GTEST_SOURCE_DIR)
  message(STATUS "mnist_ddp: the tests are left out: no GoogleTest sources (install googletest, or pass -DMNIST_DDP_GTEST_SOURCE_DIR=<a googletest checkout>)")
  return()
endif()

set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
add_subdirectory("${MNIST_DDP_GTEST_SOURCE_DIR}" "${CMAKE_BINARY_DIR}/googletest" EXCLUDE_FROM_ALL)
foreach(target gtest)
  target_compile_options(${target} PUBLIC ${TORCH_CXX_FLAGS})
  if(NOT TARGET GTest::${target})
    add_library(GTest::${target} ALIAS ${target})
  endif()
endforeach()
