// The copy worker (copy_worker.h): a FIFO of deferred copies and the thread that
// runs them, never destroyed (its thread runs until the process exits).
#include "copy_worker.h"

#include <thread>
#include <utility>

namespace offload {

CopyWorker& CopyWorker::instance() {
  static CopyWorker* worker = new CopyWorker();  // never destroyed: its thread runs until exit
  return *worker;
}

void CopyWorker::submit(std::shared_ptr<DeferredWork> work) {
  collect();
  std::lock_guard<std::mutex> lock(mutex_);
  if (!started_) {
    std::thread([this] { loop(); }).detach();
    started_ = true;
  }
  ++pending_;
  queue_.push_back(std::move(work));
  wake_.notify_one();
}

void CopyWorker::collect() {
  std::deque<std::shared_ptr<DeferredWork>> done;
  std::lock_guard<std::mutex> lock(mutex_);
  done.swap(retired_);
}  // `done` is destroyed here, after the lock is released (a dropped tensor may take the GIL)

void CopyWorker::wait_idle() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [this] { return pending_ == 0; });
}

void CopyWorker::loop() {
  for (;;) {
    std::shared_ptr<DeferredWork> work;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return !queue_.empty(); });
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    const std::exception_ptr error = work->run();
    const std::shared_ptr<Transfer::Deferred> state = work->state();
    {
      // Retired before its readers are woken: one woken reader's collect() then
      // finds it, and the sources it still references go at once.
      std::lock_guard<std::mutex> lock(mutex_);
      retired_.push_back(std::move(work));
    }
    state->publish(error);
    std::lock_guard<std::mutex> lock(mutex_);
    if (--pending_ == 0) idle_.notify_all();
  }
}

}  // namespace offload
