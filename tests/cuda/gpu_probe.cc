// SPDX-License-Identifier: Apache-2.0
// gpu_probe: says whether CUDA can use a GPU here, before the GPU bundle's run.sh runs anything.
// It links the same CUDA runtime as the bundle's tests, so when it loads, they load.
//   exit 0  at least one GPU: one line per device (name, compute capability, memory, driver)
//   exit 3  no usable GPU: one line "no GPU: <why>" (no driver, driver too old, no device)
#include <cuda_runtime_api.h>

#include <cstdio>

int main() {
  int driver = 0;
  // Without libcuda.so.1 (no NVIDIA driver) this reports 0 rather than failing.
  if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) {
    std::printf("no GPU: no NVIDIA driver (libcuda.so.1) on this machine\n");
    return 3;
  }
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess || count == 0) {
    int runtime = 0;
    (void)cudaRuntimeGetVersion(&runtime);
    std::printf("no GPU: %s (driver supports CUDA %d.%d, runtime is %d.%d)\n",
                error != cudaSuccess ? cudaGetErrorString(error) : "CUDA sees no device",
                driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
    return 3;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    std::printf("gpu %d: %s, sm_%d%d, %.1f GiB, driver CUDA %d.%d\n", i, prop.name, prop.major,
                prop.minor, static_cast<double>(prop.totalGlobalMem) / (1 << 30), driver / 1000,
                driver % 1000 / 10);
  }
  return 0;
}
