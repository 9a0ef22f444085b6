// SPDX-License-Identifier: Apache-2.0
// BLOCKKV_HOST_DEVICE marks small inline helpers that the CUDA kernels call on the device too.
#pragma once

#if defined(__CUDACC__)
#define BLOCKKV_HOST_DEVICE __host__ __device__
#else
#define BLOCKKV_HOST_DEVICE
#endif
