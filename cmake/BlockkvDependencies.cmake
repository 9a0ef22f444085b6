# SPDX-License-Identifier: Apache-2.0
# Finds what blockkv builds against. Everything comes from Debian 12's packages; nothing is
# downloaded at build time.
find_package(Threads REQUIRED)

# Highway (libhwy-dev): SIMD for the CPU kernels, with runtime dispatch. Debian ships its CMake
# config (hwy::hwy).
find_package(hwy CONFIG REQUIRED)

# XXH3 block keys for the prefix cache: Debian's libxxhash-dev, used header-only.
find_path(BLOCKKV_XXHASH_INCLUDE_DIR xxhash.h)
if(NOT BLOCKKV_XXHASH_INCLUDE_DIR)
  message(FATAL_ERROR "xxhash.h not found: apt-get install libxxhash-dev (scripts/deps.sh does)")
endif()

# ZeroMQ (libzmq3-dev): the KV events publisher (docs/kv_events.md).
find_path(BLOCKKV_ZMQ_INCLUDE_DIR zmq.h)
find_library(BLOCKKV_ZMQ_LIBRARY zmq)
if(NOT BLOCKKV_ZMQ_INCLUDE_DIR OR NOT BLOCKKV_ZMQ_LIBRARY)
  message(FATAL_ERROR "zmq.h / libzmq not found: apt-get install libzmq3-dev (scripts/deps.sh does)")
endif()

# hiredis (libhiredis-dev) for the remote prefix tier (docs/remote_tier.md); tests start Debian's
# redis-server. Debian's HiredisConfig.cmake defines no target, so find it directly.
find_path(BLOCKKV_HIREDIS_INCLUDE_DIR hiredis/hiredis.h)
find_library(BLOCKKV_HIREDIS_LIBRARY hiredis)
if(NOT BLOCKKV_HIREDIS_INCLUDE_DIR OR NOT BLOCKKV_HIREDIS_LIBRARY)
  message(FATAL_ERROR "hiredis not found: apt-get install libhiredis-dev (scripts/deps.sh does)")
endif()

# OpenSSL (libssl-dev) for the remote tier's TLS connections (rediss://).
find_package(OpenSSL 3 REQUIRED)

# UCX (libucx-dev) for sequence transfer between engines (docs/transfer.md): its ucp API,
# through pkg-config. BLOCKKV_UCX=OFF builds without it (ExportSequence / ImportSequence then
# say kUnimplemented).
if(BLOCKKV_UCX)
  find_package(PkgConfig REQUIRED)
  pkg_check_modules(BLOCKKV_UCX_PKG ucx)
  if(NOT BLOCKKV_UCX_PKG_FOUND)
    message(FATAL_ERROR "UCX (pkg-config ucx) not found: apt-get install libucx-dev (scripts/deps.sh "
                        "does), or configure with -DBLOCKKV_UCX=OFF")
  endif()
endif()

# CUDA: AUTO builds it when the toolkit is found, ON fails at configure time without it.
set(BLOCKKV_HAVE_CUDA OFF)
if(NOT BLOCKKV_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit)
  endif()
  if(CMAKE_CUDA_COMPILER AND CUDAToolkit_FOUND)
    set(BLOCKKV_HAVE_CUDA ON)
  elseif(BLOCKKV_CUDA STREQUAL "ON")
    message(FATAL_ERROR "BLOCKKV_CUDA=ON but no CUDA compiler (nvcc) or toolkit was found; "
                        "install the CUDA toolkit or set BLOCKKV_CUDA=AUTO/OFF")
  endif()
endif()

# NCCL ships inside the CUDA toolkit on these machines (/usr/local/cuda/include/nccl.h).
set(BLOCKKV_HAVE_NCCL OFF)
if(BLOCKKV_HAVE_CUDA AND NOT BLOCKKV_NCCL STREQUAL "OFF")
  find_path(BLOCKKV_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(BLOCKKV_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR}
               ${CUDAToolkit_LIBRARY_ROOT}/lib ${CUDAToolkit_LIBRARY_ROOT}/lib64)
  if(BLOCKKV_NCCL_INCLUDE_DIR AND BLOCKKV_NCCL_LIBRARY)
    set(BLOCKKV_HAVE_NCCL ON)
  endif()
endif()

# MPI: Debian's OpenMPI (libopenmpi-dev, openmpi-bin).
set(BLOCKKV_HAVE_MPI OFF)
if(NOT BLOCKKV_MPI STREQUAL "OFF")
  find_package(MPI COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    set(BLOCKKV_HAVE_MPI ON)
  elseif(BLOCKKV_MPI STREQUAL "ON")
    message(FATAL_ERROR "BLOCKKV_MPI=ON but MPI was not found; apt-get install libopenmpi-dev")
  endif()
endif()

# Python module: pybind11 (pybind11-dev, CMake config only) for Debian's /usr/bin/python3 (not
# whatever python3 comes first on PATH, e.g. a pyenv shim), and DLPack's header (libdlpack-dev)
# for the tensors it hands out. AUTO builds it when all are found, ON fails at configure time
# without them.
set(BLOCKKV_HAVE_PYTHON OFF)
if(BLOCKKV_PYTHON STREQUAL "AUTO" OR BLOCKKV_PYTHON)
  if(NOT DEFINED Python_EXECUTABLE AND EXISTS /usr/bin/python3)
    set(Python_EXECUTABLE /usr/bin/python3 CACHE FILEPATH "Python the blockkv module is built for")
  endif()
  find_package(Python 3.8 COMPONENTS Interpreter Development.Module)
  if(Python_FOUND)
    find_package(pybind11 2.10 CONFIG)
  endif()
  find_path(BLOCKKV_DLPACK_INCLUDE_DIR dlpack/dlpack.h)
  if(Python_FOUND AND pybind11_FOUND AND BLOCKKV_DLPACK_INCLUDE_DIR)
    set(BLOCKKV_HAVE_PYTHON ON)
    message(STATUS "blockkv Python module: ${Python_EXECUTABLE} (${Python_VERSION}), "
                   "pybind11 ${pybind11_VERSION}")
  elseif(NOT BLOCKKV_PYTHON STREQUAL "AUTO")
    message(FATAL_ERROR "BLOCKKV_PYTHON=ON but Python's development files, pybind11 or DLPack "
                        "were not found; apt-get install python3-dev pybind11-dev libdlpack-dev")
  endif()
endif()
