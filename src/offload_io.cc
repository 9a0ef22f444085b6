// SPDX-License-Identifier: Apache-2.0
// The pieces of offloading that are not the store's bookkeeping: the POSIX disk-tier file, host
// memory for the tiers, and block copies on a CPU device.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "blockkv/offload.h"
#include "internal/block_mover.h"
#include "internal/strings.h"

namespace blockkv {

using internal::StrCat;

const char* TierName(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "device";
    case Tier::kHost:
      return "host";
    case Tier::kDisk:
      return "disk";
  }
  return "unknown";
}

namespace {

class PosixBlockFile final : public BlockFile {
 public:
  PosixBlockFile(std::string path, int fd, bool regular)
      : path_(std::move(path)), fd_(fd), regular_(regular) {}
  ~PosixBlockFile() override {
    ::close(fd_);
    if (regular_) ::unlink(path_.c_str());  // never a device node such as /dev/full
  }

  Status Write(int64_t offset, std::span<const std::byte> data) override {
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = ::pwrite(fd_, data.data() + done, data.size() - done,
                                 static_cast<off_t>(offset + static_cast<int64_t>(done)));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Error("write", offset, errno);
      if (n == 0) return Error("write", offset, ENOSPC);  // no progress: treat as full
      done += static_cast<size_t>(n);
    }
    return Status::Ok();
  }

  Status Read(int64_t offset, std::span<std::byte> data) override {
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = ::pread(fd_, data.data() + done, data.size() - done,
                                static_cast<off_t>(offset + static_cast<int64_t>(done)));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Error("read", offset, errno);
      if (n == 0) {
        return DataLossError(StrCat(path_, ": read of ", data.size(), " bytes at offset ", offset,
                                    " ended after ", done, ": the file is truncated"));
      }
      done += static_cast<size_t>(n);
    }
    return Status::Ok();
  }

 private:
  Status Error(const char* what, int64_t offset, int error) const {
    std::string message = StrCat(path_, ": ", what, " at offset ", offset,
                                 " failed: ", std::strerror(error), " (errno ", error, ")");
    if (error == ENOSPC || error == EDQUOT) return ResourceExhaustedError(std::move(message));
    return UnavailableError(std::move(message));
  }

  std::string path_;
  int fd_;
  bool regular_;  // a regular file, removed with the BlockFile
};

void FreeAligned(std::byte* data) { std::free(data); }

class HostBlockMover final : public internal::BlockMover {
 public:
  Status ToHost(const internal::BlockLayout& layout, BlockId block, std::byte* host) override {
    const std::byte* src = layout.base + block * layout.chunk_bytes;
    for (int64_t l = 0; l < layout.layers; ++l) {
      std::memcpy(host + l * layout.chunk_bytes, src + l * layout.layer_stride,
                  static_cast<size_t>(layout.chunk_bytes));
    }
    return Status::Ok();
  }
  Status FromHost(const internal::BlockLayout& layout, const std::byte* host,
                  BlockId block) override {
    std::byte* dst = layout.base + block * layout.chunk_bytes;
    for (int64_t l = 0; l < layout.layers; ++l) {
      std::memcpy(dst + l * layout.layer_stride, host + l * layout.chunk_bytes,
                  static_cast<size_t>(layout.chunk_bytes));
    }
    return Status::Ok();
  }
  Status Finish() override { return Status::Ok(); }
};

}  // namespace

namespace {

// Writes one page of a pattern at offset 0 and reads it back: a file that does not keep what is
// written (/dev/null, /dev/zero, a full disk) is refused now rather than found out at the first
// restore, after the device blocks it stood for were freed. The page is overwritten by the first
// block stored there; every block carries its own checksum.
Status ProbeBlockFile(BlockFile& file, const std::string& path) {
  constexpr size_t kPage = 4096;
  std::vector<std::byte> page(kPage);
  std::vector<std::byte> back(kPage);
  uint64_t x = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(page.data())) ^
               static_cast<uint64_t>(::getpid()) ^ 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i < kPage; i += 8) {  // splitmix64: no two words alike, no zero page
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(page.data() + i, &z, 8);
  }
  if (const Status written = file.Write(0, page); !written.ok()) {
    return {written.code(),
            StrCat("the disk tier file ", path, " failed a probe write: ", written.message())};
  }
  const Status read = file.Read(0, back);
  if (read.code() == StatusCode::kUnavailable) {
    return {read.code(),
            StrCat("the disk tier file ", path, " failed a probe read: ", read.message())};
  }
  if (!read.ok() || back != page) {
    return InvalidArgumentError(
        StrCat("the disk tier file ", path, " does not read back what was written to it (",
               read.ok() ? std::string("different bytes") : read.message(),
               "): it cannot hold offloaded blocks; give disk_path a file on a real file system"));
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<BlockFile>> OpenPosixBlockFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int error = errno;
    std::string message = StrCat("cannot open the disk tier file ", path, ": ",
                                 std::strerror(error), " (errno ", error, ")");
    if (error == ENOENT || error == ENOTDIR) return NotFoundError(std::move(message));
    if (error == EACCES || error == EPERM || error == EROFS) {
      return PermissionDeniedError(std::move(message));
    }
    return UnavailableError(std::move(message));
  }
  struct stat st {};
  const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  auto file = std::make_unique<PosixBlockFile>(path, fd, regular);
  // A failed probe destroys the file: closed, and removed when it is a regular file.
  BLOCKKV_RETURN_IF_ERROR(ProbeBlockFile(*file, path));
  return std::unique_ptr<BlockFile>(std::move(file));
}

namespace internal {

Result<HostBuffer> AllocateHostBuffer(const Device& device, int64_t bytes) {
  if (device.kind() == DeviceKind::kCuda) return AllocatePinnedHostBuffer(device, bytes);
  constexpr int64_t kAlign = 4096;
  const int64_t rounded = (std::max<int64_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
  void* data = std::aligned_alloc(kAlign, static_cast<size_t>(rounded));
  if (data == nullptr) {
    return ResourceExhaustedError(StrCat("cannot allocate ",
                                         HumanBytes(static_cast<long double>(bytes)),
                                         " of host memory for the offload tier"));
  }
  return HostBuffer(static_cast<std::byte*>(data), bytes, FreeAligned);
}

std::unique_ptr<BlockMover> MakeHostBlockMover() { return std::make_unique<HostBlockMover>(); }

}  // namespace internal
}  // namespace blockkv
