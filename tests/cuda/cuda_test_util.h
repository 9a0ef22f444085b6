// SPDX-License-Identifier: Apache-2.0
// Shared by the CUDA tests: they skip, not fail, on a machine without a usable GPU (CI compiles
// them there so that they cannot rot; scripts/gpu-check.sh runs them on a GPU).
#pragma once

#include <cuda_runtime_api.h>

#include <gtest/gtest.h>

namespace blockkv_test {

// GPUs the CUDA runtime can use here; 0 without a driver or a device.
inline int GpuCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return 0;
  }
  return count;
}

}  // namespace blockkv_test

#define BLOCKKV_SKIP_WITHOUT_GPUS(n)                                                \
  do {                                                                              \
    if (const int gpus = ::blockkv_test::GpuCount(); gpus < (n)) {                  \
      GTEST_SKIP() << "needs " << (n) << " CUDA GPU(s), this machine has " << gpus; \
    }                                                                               \
  } while (false)

#define BLOCKKV_SKIP_WITHOUT_GPU() BLOCKKV_SKIP_WITHOUT_GPUS(1)
