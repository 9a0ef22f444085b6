// SPDX-License-Identifier: Apache-2.0
// Everything in blockkv's public API that needs no third-party headers. The MPI and NCCL
// communicators are in mpi_communicator.h and nccl_communicator.h, which include mpi.h / nccl.h.
#pragma once

#include "blockkv/block_allocator.h"  // IWYU pragma: export
#include "blockkv/block_pool.h"       // IWYU pragma: export
#include "blockkv/communicator.h"     // IWYU pragma: export
#include "blockkv/config.h"           // IWYU pragma: export
#include "blockkv/cuda_device.h"      // IWYU pragma: export
#include "blockkv/device.h"           // IWYU pragma: export
#include "blockkv/dtype.h"            // IWYU pragma: export
#include "blockkv/kernels.h"          // IWYU pragma: export
#include "blockkv/kv_cache.h"         // IWYU pragma: export
#include "blockkv/log.h"              // IWYU pragma: export
#include "blockkv/offload.h"          // IWYU pragma: export
#include "blockkv/page_table.h"       // IWYU pragma: export
#include "blockkv/ragged_batch.h"     // IWYU pragma: export
#include "blockkv/state_manager.h"    // IWYU pragma: export
#include "blockkv/status.h"           // IWYU pragma: export
#include "blockkv/tensor.h"           // IWYU pragma: export
