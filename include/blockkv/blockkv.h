// Everything in blockkv's public API.
#pragma once

#include "blockkv/block_allocator.h"  // IWYU pragma: export
#include "blockkv/communicator.h"     // IWYU pragma: export
#include "blockkv/config.h"           // IWYU pragma: export
#include "blockkv/device.h"           // IWYU pragma: export
#include "blockkv/dtype.h"            // IWYU pragma: export
#include "blockkv/kv_cache.h"         // IWYU pragma: export
#include "blockkv/log.h"              // IWYU pragma: export
#include "blockkv/status.h"           // IWYU pragma: export
#include "blockkv/tensor.h"           // IWYU pragma: export
