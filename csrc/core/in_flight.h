// The in-flight registry: tensors that queued copies still read or write, held
// until an event recorded after those copies completes. Private to csrc/core.
//
// Note [in-flight registry]
// A tensor is kept referenced here, so the caching allocator cannot give its
// memory to anyone else mid-copy even if the caller drops every tensor and the
// handle at once. One reference per tensor replaces a record_stream per tensor,
// a far costlier call in a batch of thousands. Only what must be held goes here
// (a device-to-host transfer's sources, non-pooled host sources); buffers the
// engine allocates are protected with record_stream instead, so that no device
// memory outlives a transfer merely because nobody asked about it since.
// Drained on every new transfer and on every query of one.
//
// Note [dropping tensors]
// Dropping the last C++ reference to a tensor whose Python object is alive takes
// the GIL (c10's PyObject preservation). So nothing is dropped under a lock a
// GIL holder may wait for (finished entries leave the lock first), the copy
// worker drops nothing, and the Python bindings drain with the GIL held before
// they let it go, where a drop costs little (transfer.h: release_finished_copies).
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include "offload/event_cache.h"

namespace offload {

class InFlight {
 public:
  static InFlight& instance();
  // Returns the entry's ticket for release_device_tensors(), or 0 when there was
  // nothing to hold. `drain` false: the copy worker, which must not drop tensors.
  // `at`: an event already recorded on `stream` after those copies, shared rather than
  // recording another.
  uint64_t add(const c10::Stream& stream, std::vector<at::Tensor>&& tensors, bool drain = true,
               const SharedEvent& at = nullptr);
  void drain();
  // Drops the device tensors of one entry before its event completes: the caller
  // has ordered every later user of their memory after the copies
  // (Transfer::release_sources). Host tensors stay until the event completes:
  // host memory has no stream order, so only completion makes its reuse safe.
  void release_device_tensors(uint64_t ticket);

 private:
  struct Entry {
    SharedEvent event;
    std::vector<at::Tensor> tensors;
    uint64_t ticket;
  };
  // Moves finished entries to `done`, which the caller destroys after releasing
  // the lock: dropping a tensor whose Python object is alive may take the GIL,
  // and a thread holding the GIL may be waiting for this lock (handle.query()).
  void drain_locked(std::deque<Entry>& done);
  std::mutex mutex_;
  std::deque<Entry> entries_;
  uint64_t last_ticket_ = 0;
};

}  // namespace offload
