// SPDX-License-Identifier: Apache-2.0
// TransferEndpoint in a build without UCX (BLOCKKV_UCX=OFF): it cannot be opened.
#include "transfer.h"

#include <future>

namespace blockkv::internal {

class TransferEndpoint::Impl {};

TransferEndpoint::TransferEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TransferEndpoint::~TransferEndpoint() = default;

Result<std::unique_ptr<TransferEndpoint>> TransferEndpoint::Open(
    const TransferConfig& /*config*/, std::span<const Memory> /*memory*/) {
  return UnimplementedError("this blockkv was built without UCX (BLOCKKV_UCX=OFF)");
}

const std::string& TransferEndpoint::address() const {
  static const std::string kNone;
  return kNone;
}
const std::vector<TransferRegion>& TransferEndpoint::regions() const {
  static const std::vector<TransferRegion> kNone;
  return kNone;
}
uint64_t TransferEndpoint::AddExport() { return 0; }
TransferEndpoint::Cancelled TransferEndpoint::CancelExport(uint64_t /*id*/) {
  return Cancelled::kUnknown;
}
bool TransferEndpoint::ExpireExport(uint64_t /*id*/, int32_t /*after_ms*/) { return false; }
std::vector<uint64_t> TransferEndpoint::TakeDone() { return {}; }
bool TransferEndpoint::has_done() const { return false; }
std::shared_future<Status> TransferEndpoint::Import(std::string /*peer_address*/,
                                                    std::vector<std::string> /*rkeys*/,
                                                    std::vector<TransferGet> /*gets*/,
                                                    uint64_t /*transfer_id*/,
                                                    int32_t /*timeout_ms*/) {
  std::promise<Status> done;
  done.set_value(UnimplementedError("this blockkv was built without UCX (BLOCKKV_UCX=OFF)"));
  return done.get_future().share();
}

}  // namespace blockkv::internal
