# The LibTorch mnist_ddp builds against, checked before anything compiles.
#
# Supported: LibTorch 1.13 and 2.x, for the CPU or with CUDA (the NCCL path;
# before 2.2 ProcessGroupNCCL has no shutdown(), which port.hpp allows for).
# Built and tested: 1.13.1 CPU (Debian 12), 2.6.0 CPU and 2.6.0 with CUDA
# 12.4 (Debian 13, the latter without a GPU), 2.11 with CUDA 13 (a PyTorch
# wheel, on one GPU): README.md, "Tested with". Older LibTorch stops here.
#
# A CUDA LibTorch also needs, and a pip or conda PyTorch does not bring:
# the CUDA toolkit (find_package(Torch) compiles with nvcc) and NCCL's
# header (PyTorch's NCCLUtils.hpp includes <nccl.h>). Both are looked for
# here, and what is missing is named in one line, with what installs it.
#
# Sets Torch_DIR, calls find_package(Torch), and for a CUDA LibTorch puts
# NCCL's include directory on the include path when the compiler would not
# look there by itself.

set(MNIST_DDP_OLDEST_LIBTORCH 1.13)

# One line, as written: CMake reflows an error's text unless it starts with
# a space. scripts/build.sh prints this line alone.
macro(mnist_ddp_stop text)
  message(FATAL_ERROR " mnist_ddp: ${text}")
endmacro()

# Where find_package(Torch) will find TorchConfig.cmake: Torch_DIR, else the
# prefixes it searches. A function, so that its variables stay its own.
function(mnist_ddp_check_libtorch)
  if(NOT Torch_DIR)
    string(REPLACE ":" ";" env_prefixes "$ENV{CMAKE_PREFIX_PATH}")
    foreach(prefix IN LISTS CMAKE_PREFIX_PATH env_prefixes CMAKE_SYSTEM_PREFIX_PATH)
      foreach(dir "${prefix}" "${prefix}/Torch" "${prefix}/share/cmake/Torch" "${prefix}/lib/cmake/Torch"
                  "${prefix}/lib/${CMAKE_LIBRARY_ARCHITECTURE}/cmake/Torch" "${prefix}/lib64/cmake/Torch")
        if(prefix AND EXISTS "${dir}/TorchConfig.cmake")
          set(Torch_DIR "${dir}" CACHE PATH "The directory holding TorchConfig.cmake" FORCE)
          break()
        endif()
      endforeach()
      if(Torch_DIR)
        break()
      endif()
    endforeach()
  endif()
  if(NOT EXISTS "${Torch_DIR}/TorchConfig.cmake")
    mnist_ddp_stop("no LibTorch found: install Debian's libtorch-dev (bash scripts/install_deps.sh build), or name one with -DTorch_DIR=<the directory of its TorchConfig.cmake> or -DCMAKE_PREFIX_PATH=<an unpacked LibTorch>")
  endif()

  file(STRINGS "${Torch_DIR}/TorchConfigVersion.cmake" line REGEX "set\\(PACKAGE_VERSION ")
  string(REGEX MATCH "[0-9]+(\\.[0-9]+)*" version "${line}")
  if(NOT version OR version VERSION_LESS MNIST_DDP_OLDEST_LIBTORCH)
    mnist_ddp_stop("LibTorch ${version} at ${Torch_DIR} is older than ${MNIST_DDP_OLDEST_LIBTORCH}, the oldest supported (1.13 and 2.x, CPU or CUDA): point the build at a newer one (MNIST_DDP_LIBTORCH=<its prefix> for scripts/build.sh, or -DTorch_DIR)")
  endif()
  file(STRINGS "${Torch_DIR}/../Caffe2/Caffe2Config.cmake" cuda REGEX "set\\(CAFFE2_USE_CUDA ON\\)")

  if(cuda)
    # The PyTorch's own directory (site-packages/torch, or an unpacked
    # LibTorch) and what lies beside it: pip puts NVIDIA's packages, NCCL's
    # header among them, in site-packages/nvidia/<name>/include.
    get_filename_component(torch_root "${Torch_DIR}/../../.." ABSOLUTE)
    get_filename_component(site "${torch_root}/.." ABSOLUTE)
    file(GLOB pip_includes "${site}/nvidia/*/include")
    # The CUDA version it was built with, where it says: pip's CUDA runtime
    # beside it, or an archive's build-version (2.5.1+cu124).
    set(torch_cuda "")
    file(GLOB runtime_headers "${site}/nvidia/*/include/cuda_runtime_api.h")
    if(runtime_headers)
      list(GET runtime_headers 0 header)
      file(STRINGS "${header}" line REGEX "#define CUDART_VERSION ")
      string(STRIP "${line}" line)
      if(line MATCHES "([0-9]+)([0-9][0-9])([0-9])$")
        math(EXPR minor "${CMAKE_MATCH_2}")
        set(torch_cuda "${CMAKE_MATCH_1}.${minor}")
      endif()
    elseif(EXISTS "${torch_root}/build-version")
      file(READ "${torch_root}/build-version" line)
      if(line MATCHES "cu([0-9]+)([0-9])")
        set(torch_cuda "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
      endif()
    endif()
    string(REGEX MATCH "^[0-9]+" torch_cuda_major "${torch_cuda}")
    set(nvidia_toolkit "NVIDIA's CUDA toolkit of the version this LibTorch was built with")
    if(torch_cuda_major)
      set(nvidia_toolkit "NVIDIA's CUDA ${torch_cuda_major}.x toolkit")
    else()
      set(torch_cuda_major "<CUDA major>")
    endif()

    # The CUDA toolkit: nvcc where CMake and PyTorch's FindCUDA look for it,
    # and its runtime header.
    set(nvcc_hints "")
    foreach(root "${CUDAToolkit_ROOT}" "$ENV{CUDAToolkit_ROOT}" "$ENV{CUDA_HOME}" "$ENV{CUDA_PATH}" /usr/local/cuda)
      if(root)
        list(APPEND nvcc_hints "${root}/bin")
      endif()
    endforeach()
    if(DEFINED ENV{CUDACXX})
      get_filename_component(dir "$ENV{CUDACXX}" DIRECTORY)
      list(PREPEND nvcc_hints "${dir}")
    endif()
    find_program(MNIST_DDP_NVCC nvcc HINTS ${nvcc_hints} DOC "The CUDA toolkit's compiler")
    set(toolkit "")
    if(MNIST_DDP_NVCC)
      get_filename_component(toolkit_root "${MNIST_DDP_NVCC}/../.." ABSOLUTE)
      find_path(MNIST_DDP_CUDA_INCLUDE_DIR cuda_runtime.h
        HINTS "${toolkit_root}/include" "${toolkit_root}/targets/${CMAKE_SYSTEM_PROCESSOR}-linux/include"
        DOC "The CUDA toolkit's headers")
      execute_process(COMMAND "${MNIST_DDP_NVCC}" --version OUTPUT_VARIABLE out ERROR_QUIET)
      if(out MATCHES "release ([0-9]+)\\.([0-9]+)")
        set(toolkit "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
      endif()
    endif()

    # NCCL's header: where the user says, the toolkit, the system, then pip's
    # layout beside the PyTorch, then an active conda env.
    find_path(MNIST_DDP_NCCL_INCLUDE_DIR nccl.h
      HINTS ENV NCCL_INCLUDE_DIR "$ENV{NCCL_ROOT}/include" "${MNIST_DDP_CUDA_INCLUDE_DIR}"
      PATHS "${site}/nvidia/nccl/include" ${pip_includes} "$ENV{CONDA_PREFIX}/include"
      DOC "NCCL's header directory (nccl.h)")

    # What is missing, and what installs it: Debian's packages, NVIDIA's
    # toolkit, and for a pip or conda PyTorch (site-packages/torch) the
    # packages that go beside it.
    set(cuda_of_torch "")
    if(torch_cuda)
      set(cuda_of_torch " ${torch_cuda}")
    endif()
    set(missing "")
    if(NOT MNIST_DDP_NVCC OR NOT MNIST_DDP_CUDA_INCLUDE_DIR OR NOT toolkit)
      list(APPEND missing "the CUDA toolkit${cuda_of_torch} (nvcc and cuda_runtime.h: none on PATH, in CUDA_HOME or /usr/local/cuda): apt install nvidia-cuda-toolkit on Debian/Ubuntu, or ${nvidia_toolkit}, CUDA_HOME set to it")
    elseif(torch_cuda AND NOT toolkit MATCHES "^${torch_cuda_major}\\.")
      list(APPEND missing "a CUDA toolkit ${torch_cuda_major}.x to match it (found ${toolkit}, ${MNIST_DDP_NVCC}): NVIDIA's CUDA ${torch_cuda} toolkit, with CUDA_HOME set to it")
    endif()
    if(NOT MNIST_DDP_NCCL_INCLUDE_DIR)
      set(where "NCCL_INCLUDE_DIR, NCCL_ROOT, the CUDA toolkit, the system's include paths")
      set(fix "apt install libnccl-dev on Debian/Ubuntu")
      if(torch_root MATCHES "/torch$")
        string(APPEND where ", ${site}/nvidia/nccl/include")
        string(APPEND fix ", pip install nvidia-nccl-cu${torch_cuda_major} beside this PyTorch, conda install nccl in its env")
      endif()
      list(APPEND missing "NCCL's header nccl.h (looked in ${where}): ${fix}, or NCCL_ROOT=<an NCCL install>")
    endif()
    if(missing)
      string(REPLACE ";" "; and " missing "${missing}")
      mnist_ddp_stop("LibTorch ${version} with CUDA${cuda_of_torch} (${Torch_DIR}) needs ${missing}")
    endif()
    if(NOT MNIST_DDP_NCCL_INCLUDE_DIR IN_LIST CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES)
      include_directories(SYSTEM "${MNIST_DDP_NCCL_INCLUDE_DIR}")
    endif()
    message(STATUS "mnist_ddp: CUDA toolkit ${toolkit} (${MNIST_DDP_NVCC}), NCCL header in ${MNIST_DDP_NCCL_INCLUDE_DIR}")
  endif()
endfunction()

mnist_ddp_check_libtorch()

find_package(Torch REQUIRED)
