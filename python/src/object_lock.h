// SPDX-License-Identifier: Apache-2.0
// The lock of one stateful Python object, and how a binding holds it.
//
// blockkv's C++ classes are not thread-safe (one thread schedules), but Python threads may call
// the same object at once, and several calls release the GIL (schedule_batch, copies, ticket
// waits, the kernels). So every bound method of a stateful object holds that object's ObjectLock
// while it touches C++ state:
//   - StateManager: its own lock covers the manager, its sequence descriptors, its offload store
//     and prefix cache, and the OffloadTickets of preempt_sequence / resume_sequence;
//   - BlockedKVCache: its lock covers the cache, its offload store and the store's tickets;
//   - BlockedAllocator and RaggedBatchWrapper: a lock each.
//
// Rules that keep this free of deadlocks:
//   1. No Python code runs while an object lock is held: arguments are converted to C++ values
//      before, results (and exceptions) are made into Python objects after. So no callback, no
//      __del__ and no warning filter can call back into a locked object, and locks never nest
//      through Python.
//   2. A thread never waits for an object lock while holding the GIL: it tries the lock, and if
//      another thread has it, it releases the GIL, waits, and takes the GIL back once it holds
//      the lock. The holder may need the GIL to finish (a call that released it and takes it
//      back before returning), so waiting with the GIL could deadlock.
//   3. A call that needs two locks takes them in one order: a StateManager's before a
//      RaggedBatchWrapper's (schedule_batch, post_forward(batch), insert_sequence, finalize).
//      The kernels take the batch's lock only: they read the batch and the cache's storage,
//      which a manager never reallocates.
#pragma once

#include <mutex>
#include <utility>

#include "common.h"

namespace blockkv::python {

class ObjectLock {
 public:
  ObjectLock() = default;
  ObjectLock(const ObjectLock&) = delete;
  ObjectLock& operator=(const ObjectLock&) = delete;

  // Takes the lock. REQUIRES: the GIL is held; it is released while waiting (rule 2).
  void LockHoldingGil() {
    if (mu_.try_lock()) return;
    py::gil_scoped_release release;
    mu_.lock();
  }
  // Takes the lock. REQUIRES: the GIL is not held.
  void LockWithoutGil() { mu_.lock(); }
  void Unlock() { mu_.unlock(); }

 private:
  std::mutex mu_;
};

// Unlocks on scope exit (also when C++ code inside throws).
class [[nodiscard]] UnlockOnExit {
 public:
  explicit UnlockOnExit(ObjectLock& lock) : lock_(lock) {}
  UnlockOnExit(const UnlockOnExit&) = delete;
  UnlockOnExit& operator=(const UnlockOnExit&) = delete;
  ~UnlockOnExit() { lock_.Unlock(); }

 private:
  ObjectLock& lock_;
};

// Runs fn() holding `lock`, the GIL kept: for short calls. fn runs no Python code (rule 1).
template <class Fn>
decltype(auto) Locked(ObjectLock& lock, Fn&& fn) {
  lock.LockHoldingGil();
  const UnlockOnExit unlock(lock);
  return std::forward<Fn>(fn)();
}

// Runs fn() holding `first` then `second` (a manager's lock, then a batch's: rule 3), the GIL
// kept.
template <class Fn>
decltype(auto) Locked(ObjectLock& first, ObjectLock& second, Fn&& fn) {
  first.LockHoldingGil();
  const UnlockOnExit unlock_first(first);
  second.LockHoldingGil();
  const UnlockOnExit unlock_second(second);
  return std::forward<Fn>(fn)();
}

// Runs fn() holding `lock` with the GIL released, for calls that may take long or wait (a copy,
// a kernel, a schedule that waits for a resume). REQUIRES: the GIL is held (it is back on
// return).
template <class Fn>
decltype(auto) LockedWithoutGil(ObjectLock& lock, Fn&& fn) {
  const py::gil_scoped_release release;
  lock.LockWithoutGil();
  const UnlockOnExit unlock(lock);
  return std::forward<Fn>(fn)();
}

// The same with two locks, `first` then `second` (rule 3).
template <class Fn>
decltype(auto) LockedWithoutGil(ObjectLock& first, ObjectLock& second, Fn&& fn) {
  const py::gil_scoped_release release;
  first.LockWithoutGil();
  const UnlockOnExit unlock_first(first);
  second.LockWithoutGil();
  const UnlockOnExit unlock_second(second);
  return std::forward<Fn>(fn)();
}

}  // namespace blockkv::python
