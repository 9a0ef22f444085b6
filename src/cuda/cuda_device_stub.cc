// CudaDevice when blockkv is built without CUDA (BLOCKKV_CUDA=OFF, or no toolkit found).
#include "blockkv/device.h"
#include "internal/strings.h"

namespace blockkv {

Result<std::shared_ptr<Device>> CudaDevice(int ordinal) {
  return UnavailableError(internal::StrCat(
      "CudaDevice(", ordinal,
      ") is unavailable: blockkv was built without CUDA (configure with BLOCKKV_CUDA=ON and the "
      "CUDA toolkit installed)"));
}

}  // namespace blockkv
