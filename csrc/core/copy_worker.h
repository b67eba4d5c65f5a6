// The copy worker: the one native thread that queues deferred device-to-host
// copies (Note [deferred copy] in transfer.h). Private to csrc/core.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>

#include "offload/transfer.h"

namespace offload {

// Work the copy worker runs: queue a deferred transfer's copies (CopyEngine::DeferredToHost).
// Shared: the calling thread keeps a reference while it still checks the sources.
class DeferredWork {
 public:
  virtual ~DeferredWork() = default;
  // Queues the copies; never throws: returns the failure, if any.
  virtual std::exception_ptr run() noexcept = 0;
  // What the transfer's readers wait on; holds no tensor, so the worker may drop it.
  virtual std::shared_ptr<Transfer::Deferred> state() const = 0;
};

// The process-wide copy worker: one native thread, started by the first deferred
// copy, that queues deferred copies in call order (FIFO), so two deferred copies
// on one copy stream are queued as they were called. It never takes the GIL: it
// converts nothing from Python and drops no tensor (finished work goes to
// `retired_`, destroyed by collect() in a calling thread; Note [dropping tensors]
// in in_flight.h).
class CopyWorker {
 public:
  static CopyWorker& instance();
  void submit(std::shared_ptr<DeferredWork> work);
  // Destroys finished work in the calling thread.
  void collect();
  // Blocks until every submitted copy is queued on its streams. A synchronous
  // copy into buffers that a deferred one also fills calls it first, so the
  // copies reach the copy stream in call order (free when nothing is pending).
  void wait_idle();

 private:
  void loop();
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::deque<std::shared_ptr<DeferredWork>> queue_;
  std::deque<std::shared_ptr<DeferredWork>> retired_;
  int64_t pending_ = 0;  // submitted, not yet published
  bool started_ = false;
};

}  // namespace offload
