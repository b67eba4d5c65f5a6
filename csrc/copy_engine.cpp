// The copy engine (see include/offload/transfer.h for who owns which buffer).
//
// Device to host: small tensors (< small_bytes) are packed by one multi-tensor
// copy into a device staging buffer and moved by one DMA into one pooled host
// block; large tensors move by DMA in chunk_bytes pieces into their own block.
// Host to device: host tensors that sit close together in one storage (as a
// packed block's do) move as one DMA into one device buffer, viewed per tensor;
// others move by themselves. One event per group lets a consumer wait for the
// tensor it needs rather than the whole batch.
#include "offload/transfer.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <iterator>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/extension.h>

#include "offload/bindings_registry.h"
#include "offload/checks.h"
#include "offload/event_cache.h"
#include "offload/multi_tensor_copy.h"
#include "offload/prefetch.h"
#include "offload/tensor_layout.h"
#include "offload/tensor_source.h"

namespace offload {
namespace {

constexpr int64_t kAlign = 16;                          // packed offsets: 16-byte vector copies
constexpr int64_t kMaxSpanGap = int64_t(64) << 10;      // host gap worth reading to save a DMA

int64_t align_up(int64_t value) { return (value + kAlign - 1) / kAlign * kAlign; }

// One staging buffer and one DMA (CopyOptions::group_bytes says why its size).
int64_t group_limit(const CopyOptions& options) {
  return std::max(options.small_bytes, std::min(options.chunk_bytes, options.group_bytes));
}

// Group sizes for one transfer: 1 MiB first, doubling up to group_limit. The
// first DMA then starts after the host work of a few tensors rather than of a
// full group (512 tensors of 16 KiB), and the queue is deep again by the fourth.
class GroupSizes {
 public:
  explicit GroupSizes(const CopyOptions& options)
      : limit_(group_limit(options)), current_(std::min(limit_, kFirstGroupBytes)) {}
  int64_t current() const { return current_; }
  void next() { current_ = std::min(limit_, current_ * 2); }

 private:
  static constexpr int64_t kFirstGroupBytes = int64_t(1) << 20;
  const int64_t limit_;
  int64_t current_;
};

c10::Stream current_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

std::string type_name(c10::DeviceType type) { return c10::DeviceTypeName(type, /*lower_case=*/true); }

void check_source(const char* fn, size_t i, const at::Tensor& t, c10::DeviceType expected, const at::Tensor& first) {
  // The common case in one pass (runs per tensor per call); the checks below
  // name what is wrong.
  if (C10_LIKELY(t.defined() && t.layout() == at::kStrided && t.device() == first.device() &&
                 t.device().type() == expected && !t.is_meta())) {
    return;
  }
  TORCH_CHECK_VALUE(t.defined(), fn, ": tensors[", i, "] is an undefined tensor");
  TORCH_CHECK_VALUE(!t.is_meta(), fn, ": tensors[", i, "] is a meta tensor, which has no data to copy");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, fn, ": tensors[", i, "] has layout ", t.layout(),
                    "; only strided (dense) tensors can be copied");
  TORCH_CHECK_VALUE(t.device().type() == expected, fn, ": tensors[", i, "] is on ", t.device(), " but a ",
                    type_name(expected), " tensor is expected (data on ",
                    expected == c10::DeviceType::CPU ? "the host" : "an accelerator", ")");
  TORCH_CHECK_VALUE(t.device() == first.device(), fn, ": tensors[", i, "] is on ", t.device(),
                    " but tensors[0] is on ", first.device(), "; all tensors must share one device");
}

void check_out(const char* fn, size_t i, const at::Tensor& src, const at::Tensor& dst, const c10::Device& where,
               bool require_pinned, bool pinning) {
  TORCH_CHECK_VALUE(dst.defined(), fn, ": out[", i, "] is an undefined tensor");
  TORCH_CHECK_VALUE(dst.sizes() == src.sizes() && dst.scalar_type() == src.scalar_type(), fn, ": out[", i,
                    "] has ", describe(dst), " but tensors[", i, "] has ", describe(src));
  TORCH_CHECK_VALUE(dst.device().type() == where.type(), fn, ": out[", i, "] is on ", dst.device(), " but a ",
                    type_name(where.type()), " tensor is expected");
  if (where.type() != c10::DeviceType::CPU) {
    TORCH_CHECK_VALUE(dst.device() == where, fn, ": out[", i, "] is on ", dst.device(), " but the destination is ",
                      where);
  } else if (require_pinned && pinning && dst.numel() > 0) {  // nothing to move, nothing to pin
    TORCH_CHECK_VALUE(dst.is_pinned(), fn, ": out[", i, "] is not pinned, so the copy would block the host; pass "
                      "pinned memory (offload.HostPool.empty, tensor.pin_memory()) or require_pinned=False");
  }
}

// Copies `nbytes` from `src` to `dst` in pieces of at most `chunk_bytes`, on the
// current stream of `device`.
void copy_chunked(char* dst, bool dst_on_host, const char* src, bool src_on_host, int64_t nbytes,
                  int64_t chunk_bytes, const c10::Device& device) {
  for (int64_t at = 0; at < nbytes; at += chunk_bytes) {
    copy_bytes_async(dst + at, dst_on_host, src + at, src_on_host, std::min(chunk_bytes, nbytes - at), device);
  }
}

// Copies the bytes of dense `src` into dense `dst` (identical strides), in chunks,
// on the current stream of `device`.
void copy_bytes(const at::Tensor& dst, const at::Tensor& src, int64_t chunk_bytes, const c10::Device& device) {
  copy_chunked(static_cast<char*>(dst.data_ptr()), dst.is_cpu(), static_cast<const char*>(src.data_ptr()),
               src.is_cpu(), tensor_nbytes(src), chunk_bytes, device);
}

bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.strides() == b.strides() && a.scalar_type() == b.scalar_type();
}

}  // namespace

// Tensors that copies still read or write, kept referenced until an event
// recorded after those copies completes, so the caching allocator cannot give
// that memory to anyone else mid-copy even if the caller drops every tensor and
// the handle at once. One reference per tensor here replaces a record_stream
// per tensor, which cost ~1 us each in a 4096-tensor batch. Only what must be
// held goes here (a device-to-host transfer's sources); buffers the engine
// allocates are protected with record_stream instead, so that no device
// memory outlives a transfer merely because nobody asked about it since.
// Drained on every new transfer and on every query of one.
class InFlight {
 public:
  static InFlight& instance() {
    static InFlight* registry = new InFlight();  // never destroyed: it may hold CUDA tensors at exit
    return *registry;
  }
  // Returns the entry's ticket for release_device_tensors(), or 0 when there was
  // nothing to hold. `drain` false: the copy worker, which must not drop tensors.
  uint64_t add(const c10::Stream& stream, std::vector<at::Tensor>&& tensors, bool drain = true) {
    std::deque<Entry> done;  // destroyed after the lock is released (see drain_locked)
    std::lock_guard<std::mutex> lock(mutex_);
    if (drain) drain_locked(done);
    if (tensors.empty()) return 0;
    entries_.push_back(Entry{take_event(stream.device()), std::move(tensors), ++last_ticket_});
    entries_.back().event.record(stream);
    return last_ticket_;
  }
  void drain() {
    std::deque<Entry> done;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      drain_locked(done);
    }
  }  // `done` is destroyed here, outside the lock (see drain_locked)
  // Drops the device tensors of one entry before its event completes: the caller
  // has ordered every later user of their memory after the copies
  // (Transfer::release_sources). Host tensors stay until the event completes:
  // host memory has no stream order, so only completion makes its reuse safe.
  void release_device_tensors(uint64_t ticket) {
    std::vector<at::Tensor> dropped;  // destroyed after the lock is released (see drain_locked)
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->ticket != ticket) continue;
      std::vector<at::Tensor> kept;
      for (auto& t : it->tensors) (t.is_cpu() ? kept : dropped).push_back(std::move(t));
      it->tensors = std::move(kept);
      if (it->tensors.empty()) {
        give_back_event(std::move(it->event));
        entries_.erase(it);
      }
      return;
    }
  }

 private:
  struct Entry {
    c10::Event event;
    std::vector<at::Tensor> tensors;
    uint64_t ticket;
  };
  // Moves finished entries to `done`, which the caller destroys after releasing
  // the lock: dropping a tensor whose Python object is alive may take the GIL,
  // and a thread holding the GIL may be waiting for this lock (handle.query()).
  void drain_locked(std::deque<Entry>& done) {
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->event.query()) {
        give_back_event(std::move(it->event));
        done.push_back(std::move(*it));
        it = entries_.erase(it);
      } else {
        it = std::next(it);
      }
    }
  }
  std::mutex mutex_;
  std::deque<Entry> entries_;
  uint64_t last_ticket_ = 0;
};

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
// `retired_`, destroyed by collect() in a calling thread; see transfer.h).
class CopyWorker {
 public:
  static CopyWorker& instance() {
    static CopyWorker* worker = new CopyWorker();  // never destroyed: its thread runs until exit
    return *worker;
  }
  void submit(std::shared_ptr<DeferredWork> work) {
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
  // Destroys finished work in the calling thread.
  void collect() {
    std::deque<std::shared_ptr<DeferredWork>> done;
    std::lock_guard<std::mutex> lock(mutex_);
    done.swap(retired_);
  }  // `done` is destroyed here, after the lock is released (a dropped tensor may take the GIL)
  // Blocks until every submitted copy is queued on its streams. A synchronous
  // copy into buffers that a deferred one also fills calls it first, so the
  // copies reach the copy stream in call order (free when nothing is pending).
  void wait_idle() {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  void loop() {
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
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::deque<std::shared_ptr<DeferredWork>> queue_;
  std::deque<std::shared_ptr<DeferredWork>> retired_;
  int64_t pending_ = 0;  // submitted, not yet published
  bool started_ = false;
};

void Transfer::wait_enqueued() const {
  if (!deferred_) return;
  Deferred& d = *deferred_;
  if (!d.ready.load(std::memory_order_acquire)) {
    std::unique_lock<std::mutex> lock(d.mutex);
    d.queued.wait(lock, [&d] { return d.ready.load(std::memory_order_acquire); });
  }
  CopyWorker::instance().collect();
  if (d.error) std::rethrow_exception(d.error);
}

void Transfer::Deferred::publish(std::exception_ptr failure) {
  std::lock_guard<std::mutex> lock(mutex);
  error = failure;
  ready.store(true, std::memory_order_release);
  queued.notify_all();
}

CopyTimer::~CopyTimer() {
  if (start) give_back_event(std::move(*start));
  if (end) give_back_event(std::move(*end));
}

c10::optional<double> CopyTimer::seconds() const {
  if (host_seconds) return host_seconds;
  if (!start || !end || !end->query()) return c10::nullopt;
  return start->elapsedTime(*end) / 1000.0;  // c10 reports milliseconds
}

namespace {
void check_timed(const char* fn, const std::shared_ptr<CopyTimer>& timer) {
  TORCH_CHECK_VALUE(timer != nullptr, fn, ": this copy was not timed; pass timing=True to offload.copy_to_host or "
                    "offload.copy_to_device");
}
}  // namespace

c10::optional<double> Transfer::copy_seconds() const {
  check_timed("offload.CopyHandle.copy_seconds", timer_);
  if (enqueue_pending()) return c10::nullopt;  // never waits
  wait_enqueued();                             // raises a deferred copy's failure
  return timer_->seconds();
}

std::shared_ptr<CopyTimer> Transfer::timer() const {
  check_timed("offload.CopyHandle.copy_timer", timer_);
  wait_enqueued();  // the events are recorded once the copies are queued
  return timer_;
}

bool Transfer::query(bool drain) const {
  wait_enqueued();
  // The timing end event is recorded after the last completion event: done means
  // both, so copy_seconds() has its answer once a handle is seen done.
  const bool done = (events_.empty() || events_.back().query()) && (!timer_ || timer_->done());
  if (done && drain) InFlight::instance().drain();
  return done;
}

void Transfer::release_keepalive(const c10::optional<c10::Stream>& stream, bool drain) {
  if (stream && !keepalive_.empty()) {
    const uint64_t ticket = InFlight::instance().add(*stream, std::move(keepalive_), drain);
    if (ticket != 0) inflight_tickets_.push_back(ticket);
  }
  keepalive_.clear();
}

void Transfer::release_sources(const c10::optional<c10::Stream>& stream) {
  const auto waiter = consumer(stream);
  if (!waiter) return;  // a host transfer holds nothing
  wait_stream(*waiter);  // waits for a deferred transfer's copies to be queued
  for (uint64_t ticket : inflight_tickets_) InFlight::instance().release_device_tensors(ticket);
  inflight_tickets_.clear();
}

Transfer::~Transfer() {
  for (auto& event : events_) give_back_event(std::move(event));
}

void Transfer::mark_complete(const c10::Stream& stream, const std::vector<int64_t>& members) {
  events_.push_back(take_event(stream.device()));
  events_.back().record(stream);
  for (int64_t i : members) event_of_[i] = static_cast<int32_t>(events_.size() - 1);
}

void Transfer::synchronize(bool drain) const {
  try {
    wait_enqueued();
  } catch (...) {  // a failed deferred transfer: let what it queued finish, then say why
    if (!events_.empty()) events_.back().synchronize();
    throw;
  }
  if (!events_.empty()) events_.back().synchronize();
  if (timer_) timer_->synchronize();  // its end is recorded after the last event (see query)
  if (drain) InFlight::instance().drain();
}

c10::optional<c10::Stream> Transfer::consumer(const c10::optional<c10::Stream>& stream) const {
  if (stream || device_.is_cpu()) return stream;
  // The current stream, read here rather than by the caller in Python (a Python
  // stream object per call cost microseconds on every wait).
  return c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
}

void Transfer::wait_stream(const c10::optional<c10::Stream>& stream) const {
  wait_enqueued();
  // Events are recorded in order on one copy stream: the last implies the rest.
  if (events_.empty()) return;
  if (const auto waiter = consumer(stream)) events_.back().block(*waiter);
}

void Transfer::wait_stream_for(int64_t index, const c10::optional<c10::Stream>& stream) const {
  TORCH_CHECK_INDEX(index >= 0 && index < static_cast<int64_t>(outputs_->size()), "offload.CopyHandle.wait_tensor: ",
                    "index ", index, " out of range for ", outputs_->size(), " tensors");
  wait_enqueued();
  const int32_t event = event_of_[index];
  if (event < 0) return;
  if (const auto waiter = consumer(stream)) events_[event].block(*waiter);
}

// A side stream per device for packing, so that packing group k+1 on the SMs
// overlaps the DMA of group k on the copy engine (on one stream they would
// take turns, ~6% of a small-tensor transfer).
c10::Stream pack_stream(const c10::Device& device) {
  // Never destroyed: the copy worker may still ask for a stream while statics are torn down at exit.
  static auto* mutex = new std::mutex();
  static auto* streams = new std::map<std::pair<int, int>, c10::Stream>();
  std::lock_guard<std::mutex> lock(*mutex);
  const auto key = std::make_pair(static_cast<int>(device.type()), static_cast<int>(device.index()));
  auto it = streams->find(key);
  if (it == streams->end()) {
    it = streams->emplace(key, c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device)).first;
  }
  return it->second;
}

// Staging buffers a device-to-host transfer packs into: kSlots of them, reused
// in turn; packing into a slot waits (on the device) for the DMA that last read it.
constexpr int kSlots = 3;

class CopyEngine {
 public:
  // ------------------------------------------------------------ device -> host
  static std::shared_ptr<Transfer> to_host(TensorSource& tensors, HostPool& pool,
                                           const c10::optional<c10::Stream>& stream,
                                           const c10::optional<std::vector<at::Tensor>>& out,
                                           const std::shared_ptr<Transfer>& reuse, const CopyOptions& options) {
    const char* fn = "offload.copy_to_host";
    const c10::DeviceType expected = pool.device_type();
    const size_t n = tensors.size();
    check_same_sources(options, reuse);
    // Into buffers a deferred copy may also fill: after that copy, as called.
    if (out || reuse) CopyWorker::instance().wait_idle();
    // With out= every tensor is checked here; otherwise each is checked as its
    // group is prepared (ToHost::prepare_member), so the first DMA need not wait
    // for the checks of thousands of tensors behind it.
    if (out) {
      for (size_t i = 0; i < n; ++i) check_source(fn, i, tensors[i], expected, tensors[0]);
    } else if (n > 0) {
      check_source(fn, 0, tensors[0], expected, tensors[0]);
    }
    if (out) {
      TORCH_CHECK_VALUE(out->size() == n, fn, ": out has ", out->size(), " tensors but tensors has ", n);
      for (size_t i = 0; i < n; ++i) check_out(fn, i, tensors[i], (*out)[i], c10::Device(at::kCPU),
                                               options.require_pinned, pool.pinned());
    } else if (reuse) {
      check_reuse_count(*reuse, n);
    }
    const c10::Device device = n ? tensors[0].device() : c10::Device(at::kCPU);
    const bool on_device = !device.is_cpu();
    TORCH_CHECK_VALUE(!on_device || stream.has_value(), fn, ": a copy stream is required for ", device);

    auto result = std::make_shared<Transfer>(device);
    ToHost job(tensors, pool, stream, options, *result, on_device);
    try {
      job.run(out, reuse);
      job.end_timing();
    } catch (...) {
      hold_sources(*result, tensors, on_device, stream);  // copies already queued keep their tensors
      throw;
    }
    hold_sources(*result, tensors, on_device, stream);
    job.finish_views(out.has_value(), reuse);
    return result;
  }

  // ------------------------------------------- device -> host, queued by the worker
  static std::shared_ptr<Transfer> to_host_deferred(std::unique_ptr<TensorSource> owned, HostPool& pool,
                                                    const c10::optional<c10::Stream>& stream,
                                                    const std::shared_ptr<Transfer>& reuse,
                                                    const CopyOptions& options,
                                                    const std::function<void()>& converted) {
    const char* fn = "offload.copy_to_host";
    TORCH_CHECK_VALUE(reuse != nullptr, fn, ": defer=True needs out=<CopyHandle> (an earlier copy_to_host of "
                      "tensors of the same shapes and dtypes, whose host buffers it refills), got none");
    check_same_sources(options, reuse);
    TensorSource& tensors = *owned;
    const size_t n = tensors.size();
    const c10::DeviceType expected = pool.device_type();
    // Every source converted, then the caller told (transfer.h): nothing converts after.
    auto finish_conversion = [&tensors, &converted] {
      tensors.convert_all();
      if (converted) converted();
    };
    // Where there is nothing to defer, the copy runs here (transfer.h says why).
    // As in to_host, tensors[0] is checked against the pool here and every other
    // tensor against tensors[0] once, when check_group checks it against the handle.
    if (n > 0) check_source(fn, 0, tensors[0], expected, tensors[0]);
    if (n == 0 || reuse->groups_.empty() || tensors[0].is_cpu()) {
      finish_conversion();
      return to_host(tensors, pool, stream, c10::nullopt, reuse, options);
    }
    check_reuse_count(*reuse, n);
    const c10::Device device = tensors[0].device();
    TORCH_CHECK_VALUE(stream.has_value(), fn, ": a copy stream is required for ", device);
    auto job = std::make_shared<DeferredToHost>(std::move(owned), pool.shared_from_this(), stream, options, device);
    ToHost& plan = *job->plan;
    // Every check the synchronous path makes, here, so a stale handle raises now.
    // This thread checks the sources group by group and queues the first group
    // itself; the copy worker queues each later group as soon as this thread has
    // checked it (ToHost::follow_checks), so the copies run while the rest are
    // converted and checked, and this thread queues nothing else. (It used to
    // queue the first groups up to 32 KiB a source itself, then hand the rest
    // over: ~0.5 ms of a 4,000-tensor refill's ~1.9 ms in the caller on the H100.)
    const size_t groups = plan.adopt_groups(*reuse);
    if (!plan.check_group(0, *reuse, /*deferred=*/true)) {  // a source needs a kernel first: the synchronous way
      std::unique_ptr<TensorSource> source = std::move(job->source);
      job.reset();
      finish_conversion();
      return to_host(*source, pool, stream, c10::nullopt, reuse, options);
    }
    // Earlier deferred copies into these buffers are queued before this one's.
    // Called from Python, this waits with the GIL held: the worker never takes
    // it, and it is busy only while a previous deferred copy's groups are still
    // being queued.
    CopyWorker::instance().wait_idle();
    // The snapshot point: every group, queued here or by the worker, is copied
    // after the caller's work up to this record (the copy and pack streams wait
    // on it), so work another thread queues on that stream meanwhile is in none.
    job->snapshot.emplace(take_event(device));
    job->snapshot->record(current_stream(device));
    plan.set_snapshot(*job->snapshot);
    auto result = job->result;
    size_t checked = 1;
    bool handed_off = false;
    try {
      if (groups > 1) {
        // Submitted first, so the worker is awake (and spinning) by the time the
        // second group is checked: a wake-up takes tens of microseconds, more
        // than the first group's DMA (1 MiB: ~20 us).
        result->deferred_ = std::make_shared<Transfer::Deferred>();
        CopyWorker::instance().submit(job);
        handed_off = true;
      }
      plan.enqueue_here(0, 1, *reuse, /*check_from=*/1);
      if (handed_off) {
        plan.reserve_slots();  // the worker allocates nothing
        // Each group is published once checked, while its tensors are still in
        // the caches (see lazy_conversion's prefetching).
        while (checked < groups && plan.check_group(checked, *reuse, /*deferred=*/true)) {
          job->checked.store(++checked, std::memory_order_release);
        }
      }
      if (checked == groups) {
        tensors.convert_all();  // tensors in no group (empty ones), checked by finish_views
        plan.finish_views(/*into_out=*/false, reuse);
        if (!handed_off) {
          plan.end_timing();
          hold_sources(*result, job->source->converted(), stream);
          return result;
        }
        // From here the job is the worker's: it queues what is left, then takes the sources.
        job->handoff.store(DeferredToHost::kComplete, std::memory_order_release);
        return result;
      }
    } catch (...) {
      if (handed_off) job->take_back();
      hold_sources(*result, job->source->converted(), stream);  // copies already queued keep their tensors
      throw;
    }
    // A source needs a new tensor (a kernel this thread orders on the copy
    // stream): the worker stops where it is and the rest is copied here, as a
    // synchronous copy does.
    try {
      job->take_back();
      finish_conversion();
      plan.enqueue_here(plan.queued_groups(), groups, *reuse, /*check_from=*/checked);
      plan.end_timing();
      plan.finish_views(/*into_out=*/false, reuse);
    } catch (...) {
      hold_sources(*result, job->source->converted(), stream);
      throw;
    }
    hold_sources(*result, job->source->converted(), stream);
    return result;
  }

  // ------------------------------------------- byte spans of storages -> one host block
  static std::shared_ptr<Transfer> spans_to_host(const std::vector<at::Tensor>& sources,
                                                 const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes,
                                                 const at::Tensor& given_out, int64_t out_bytes,
                                                 const std::vector<int64_t>& offsets, HostPool& pool,
                                                 const c10::optional<c10::Stream>& stream,
                                                 const CopyOptions& options) {
    const char* fn = "offload.copy_spans_to_host";
    const size_t n = sources.size();
    TORCH_CHECK_VALUE(starts.size() == n && sizes.size() == n && offsets.size() == n, fn,
                      ": tensors, starts, sizes and offsets need one entry per span, got ", n, ", ", starts.size(),
                      ", ", sizes.size(), " and ", offsets.size());
    if (given_out.defined()) {
      TORCH_CHECK_VALUE(given_out.is_cpu() && given_out.scalar_type() == at::kByte && given_out.dim() == 1 &&
                            given_out.is_contiguous(),
                        fn, ": out must be a 1-d uint8 host tensor (a HostPool block), got ", describe(given_out));
      TORCH_CHECK_VALUE(pool.owns(given_out), fn, ": out must be a block of the pool the copy records on "
                        "(HostPool.acquire), so it is not reused before the copy completes");
    } else {
      TORCH_CHECK_VALUE(out_bytes >= 0, fn, ": out must be a HostPool block or its size in bytes (>= 0), got ",
                        out_bytes);
    }
    const c10::DeviceType expected = pool.device_type();
    const int64_t out_numel = given_out.defined() ? given_out.numel() : out_bytes;
    int64_t total = 0;
    for (size_t i = 0; i < n; ++i) {
      check_source(fn, i, sources[i], expected, sources[0]);
      const int64_t storage_bytes = static_cast<int64_t>(sources[i].storage().nbytes());
      TORCH_CHECK_VALUE(starts[i] >= 0 && sizes[i] >= 0 && starts[i] + sizes[i] <= storage_bytes, fn, ": span ", i,
                        " is bytes [", starts[i], ", ", starts[i] + sizes[i], ") of a storage of ", storage_bytes,
                        " bytes");
      TORCH_CHECK_VALUE(offsets[i] >= 0 && offsets[i] + sizes[i] <= out_numel, fn, ": span ", i, " goes to bytes [",
                        offsets[i], ", ", offsets[i] + sizes[i], ") of out, which has ", out_numel);
      total += sizes[i];
    }
    const c10::Device device = n ? sources[0].device() : c10::Device(at::kCPU);
    const bool on_device = !device.is_cpu();
    TORCH_CHECK_VALUE(!on_device || stream.has_value(), fn, ": a copy stream is required for ", device);
    const at::Tensor out = given_out.defined() ? given_out : pool.allocate(static_cast<size_t>(out_bytes));
    auto result = std::make_shared<Transfer>(device);
    result->nbytes_ = total;
    if (options.timing) result->timer_ = std::make_shared<CopyTimer>();
    result->outputs_->push_back(out);
    result->host_bases_->push_back(out);
    result->event_of_.assign(1, -1);
    char* dst = static_cast<char*>(out.data_ptr());
    auto copy_all = [&] {
      for (size_t i = 0; i < n; ++i) {
        const char* src = static_cast<const char*>(sources[i].storage().data()) + starts[i];
        copy_chunked(dst + offsets[i], true, src, !on_device, sizes[i], options.chunk_bytes, device);
      }
    };
    if (!on_device) {  // host to host: done on return
      const auto start = std::chrono::steady_clock::now();
      copy_all();
      if (options.timing) result->timer_->stop_host_clock(start);
      return result;
    }
    {
      // The copy stream waits for the caller's work so far (the values the spans
      // hold now); the pool holds `out` back until the copies complete, and the
      // transfer holds the sources (their storages) until then.
      c10::DeviceGuard on_device_guard(device);
      order_after(*stream, current_stream(device));
      c10::StreamGuard on_copy(*stream);
      if (options.timing) record_timing(result->timer_->start, *stream);  // after the wait: the copies only
      copy_all();
      if (!pool.record_stream(out, *stream)) result->keepalive_.push_back(out);
      result->mark_complete(*stream, {0});
      if (options.timing) record_timing(result->timer_->end, *stream);
    }
    hold_sources(*result, sources, stream);
    return result;
  }

  // ------------------------------------------------------------ host -> device
  static std::shared_ptr<Transfer> to_device(TensorSource& tensors,
                                             const std::shared_ptr<Transfer>& from, const c10::Device& device,
                                             HostPool& pool, const c10::optional<c10::Stream>& stream,
                                             const c10::optional<std::vector<at::Tensor>>& out,
                                             const CopyOptions& options) {
    const char* fn = "offload.copy_to_device";
    const size_t n = tensors.size();
    const bool on_device = n > 0 && !device.is_cpu();
    // Without out= each source is checked as its span is formed (ToDevice::check_member),
    // so the first DMA need not wait for the checks of thousands of tensors behind it.
    if (out) {
      TORCH_CHECK_VALUE(out->size() == n, fn, ": out has ", out->size(), " tensors but tensors has ", n);
      for (size_t i = 0; i < n; ++i) {
        check_source(fn, i, tensors[i], c10::DeviceType::CPU, tensors[0]);
        check_out(fn, i, tensors[i], (*out)[i], device, options.require_pinned, false);
      }
    }
    TORCH_CHECK_VALUE(!on_device || stream.has_value(), fn, ": a copy stream is required for ", device);

    auto result = std::make_shared<Transfer>(device);
    ToDevice job(tensors, from, device, pool, stream, out, options, *result);
    try {
      job.run();
    } catch (...) {
      result->release_keepalive(stream);  // copies already queued keep their host sources
      throw;
    }
    result->release_keepalive(stream);
    return result;
  }

 private:
  // A timing event from the cache, recorded on `stream`.
  static void record_timing(c10::optional<c10::Event>& event, const c10::Stream& stream) {
    event.emplace(take_event(stream.device(), c10::EventFlag::BACKEND_DEFAULT));
    event->record(stream);
  }

  // A device-to-host transfer holds its sources until its copies complete. They
  // are handed over once queued (or on failure, those converted so far), not
  // before, so the first copy does not wait for thousands of reference counts.
  static void hold_sources(Transfer& r, const std::vector<at::Tensor>& sources,
                           const c10::optional<c10::Stream>& stream) {
    r.keepalive_.insert(r.keepalive_.end(), sources.begin(), sources.end());
    r.release_keepalive(stream);
  }

  static void hold_sources(Transfer& r, TensorSource& tensors, bool on_device,
                           const c10::optional<c10::Stream>& stream) {
    hold_sources(r, on_device ? tensors.converted() : std::vector<at::Tensor>(), stream);
  }

  static void check_same_sources(const CopyOptions& options, const std::shared_ptr<Transfer>& reuse) {
    TORCH_CHECK_VALUE(!options.same_sources || (reuse && reuse->source_keys_), "offload.copy_to_host: "
                      "same_sources=True needs out=<CopyHandle> from a copy_to_host without out (whose buffers "
                      "the engine made), got ", reuse ? "a handle made with an out list" : "none");
  }

  static void check_reuse_count(const Transfer& reuse, size_t n) {
    TORCH_CHECK_VALUE(reuse.host_bases_->size() == n, "offload.copy_to_host: out has ", reuse.host_bases_->size(),
                      " tensors but tensors has ", n);
  }

  // Whether prepare() would make a new tensor (a kernel) for `t`.
  static bool needs_new_tensor(const at::Tensor& t) {
    if (t.is_conj() || t.is_neg()) return true;
    if (t.is_contiguous()) return false;
    bool expanded = false;
    return !is_dense(compact(t, &expanded));
  }

  // The per-tensor work both directions share: what is read, and its size.
  struct Prepared {
    at::Tensor base;  // compact (broadcast dims narrowed) and dense
    bool expanded = false;
    bool made_contiguous = false;
    bool resolved = false;  // a conj/neg view resolved into a new tensor
    int64_t nbytes = 0;
  };

  static Prepared prepare(const at::Tensor& t, bool allow_contiguous) {
    Prepared p;
    if (t.is_conj() || t.is_neg()) {
      // A lazily conjugated or negated view (z.conj(), torch._neg_view) shares its
      // base's bytes and carries a flag: its bytes are not its values. Moved as
      // bytes it arrived as the base's values. Resolved into a new tensor here, on
      // the current stream (the copy stream for a device source; the host for a
      // host source), and treated like a contiguous() copy: held until copied,
      // waited for by the pack stream (its own strides are kept: dense).
      p = prepare(t.resolve_conj().resolve_neg(), allow_contiguous);
      p.resolved = true;
      return p;
    }
    if (t.is_contiguous() && t.numel() > 0) {  // most tensors: no broadcast dims, dense as they are
      p.base = t;
      p.nbytes = tensor_nbytes(t);
      return p;
    }
    p.base = compact(t, &p.expanded);
    if (allow_contiguous && !is_dense(p.base)) {
      p.base = p.base.contiguous();
      p.made_contiguous = true;
    }
    p.nbytes = tensor_nbytes(p.base);
    return p;
  }

  // One device-to-host transfer, enqueued group by group: each group is queued
  // as soon as its members are prepared, so the copy engine starts after the
  // first group's host work instead of after every tensor's.
  class ToHost {
   public:
    ToHost(TensorSource& tensors, HostPool& pool, const c10::optional<c10::Stream>& stream,
           const CopyOptions& options, Transfer& r, bool on_device)
        : tensors_(tensors), pool_(pool), stream_(stream), options_(options), r_(r), on_device_(on_device),
          device_(r.device_), n_(tensors.size()), prepared_(n_) {
      r_.event_of_.assign(n_, -1);
      if (options.timing) r_.timer_ = std::make_shared<CopyTimer>();
    }
    ~ToHost() {
      if (packed_) give_back_event(std::move(*packed_));
    }
    ToHost(const ToHost&) = delete;
    ToHost& operator=(const ToHost&) = delete;

    void run(const c10::optional<std::vector<at::Tensor>>& out, const std::shared_ptr<Transfer>& reuse) {
      if (on_device_) {
        device_guard_.reset_device(device_);
        caller_ = current_stream(device_);
        wait_for_caller(*stream_);
        stream_guard_.emplace(*stream_);
      }
      start_timing();
      if (reuse && !reuse->groups_.empty()) {
        adopt_groups(*reuse);
        for (auto& group : r_.groups_) {
          check_reused(group, *reuse, /*deferred=*/false);
          enqueue(group);
        }
        return;
      }
      r_.outputs_->resize(n_);
      r_.host_bases_->resize(n_);
      if (out) return run_into(*out);
      if (reuse) return run_into(*reuse->host_bases_);  // a handle made with out=<list>
      GroupSizes sizes(options_);
      Transfer::Group packed;
      packed.packed = true;
      for (size_t i = 0; i < n_; ++i) {
        const int64_t nbytes = prepare_member(static_cast<int64_t>(i));
        if (nbytes == 0) continue;
        if (nbytes >= options_.small_bytes) {
          Transfer::Group direct;
          direct.bytes = nbytes;
          direct.members.push_back(static_cast<int64_t>(i));
          r_.groups_.push_back(std::move(direct));
          enqueue(r_.groups_.back());
          continue;
        }
        int64_t offset = align_up(packed.bytes);
        if (!packed.members.empty() && offset + nbytes > sizes.current()) {
          r_.groups_.push_back(std::move(packed));
          enqueue(r_.groups_.back());
          sizes.next();
          packed = Transfer::Group();
          packed.packed = true;
          offset = 0;
        }
        packed.members.push_back(static_cast<int64_t>(i));
        packed.offsets.push_back(offset);
        packed.bytes = offset + nbytes;
      }
      if (!packed.members.empty()) {
        r_.groups_.push_back(std::move(packed));
        enqueue(r_.groups_.back());
      }
    }

    // A refill, in the calling thread: takes the handle's groups and host tensors
    // (shared: see Transfer::outputs_); returns the groups' count.
    size_t adopt_groups(const Transfer& reuse) {
      r_.groups_ = reuse.groups_;
      r_.outputs_ = reuse.outputs_;
      r_.host_bases_ = reuse.host_bases_;
      return r_.groups_.size();
    }

    // A deferred copy, in the calling thread: checks the members of group `g`
    // against the handle. False where a member needs a new tensor first (a
    // kernel this thread would have to order); its earlier members stay checked.
    bool check_group(size_t g, const Transfer& reuse, bool deferred) {
      return check_reused(r_.groups_[g], reuse, deferred);
    }

    // A deferred copy: the event the copy and pack streams wait on (its job owns it).
    void set_snapshot(const c10::Event& snapshot) { snapshot_ = &snapshot; }

    // A deferred copy, in the calling thread: queues groups [from, to) on the copy
    // stream as run() does, checking those from `check_from` on first (the
    // synchronous way: a source that needs a new tensor gets it on the copy stream).
    // The first call makes the copy stream wait on the snapshot and starts the
    // timing; guards are local (the worker may finish this plan).
    void enqueue_here(size_t from, size_t to, const Transfer& reuse, size_t check_from) {
      if (from >= to) return;
      c10::DeviceGuard on_device(device_);
      if (queued_groups_ == 0) {
        wait_for_caller(*stream_);
        start_timing();
      }
      c10::StreamGuard on_copy(*stream_);
      for (size_t g = from; g < to; ++g) {
        if (g >= check_from) check_reused(r_.groups_[g], reuse, /*deferred=*/false);
        enqueue(r_.groups_[g]);
      }
      queued_groups_ = to;
    }

    // A deferred copy, on the copy worker: queues the groups from the second on,
    // each once `checked` (the calling thread's count of checked groups, which it
    // raises past 1 only after queueing the first group and reserving the slots)
    // passes it, until `handoff` leaves kChecking; returns that state, with every
    // group below the final count queued. The calling thread queued the first
    // group, so the copy stream already waits on the snapshot, the pack stream
    // where a packed group came first (else enqueue_packed makes it wait).
    // Spins while the caller checks (well under a millisecond a refill): a
    // wake-up per group would cost the caller a notify each.
    int follow_checks(const std::atomic<size_t>& checked, const std::atomic<int>& handoff, int checking) {
      c10::DeviceGuard on_device(device_);
      c10::StreamGuard on_copy(*stream_);
      size_t next = 1;  // queued_groups_ is the caller's until it hands off
      for (;;) {
        const int state = handoff.load(std::memory_order_acquire);
        const size_t limit = checked.load(std::memory_order_acquire);  // final once state is not `checking`
        while (next < limit) {
          try {
            enqueue(r_.groups_[next]);
          } catch (...) {
            // The caller may take the job back after this (a later source fails
            // its check) and goes on from queued_groups_: the groups queued so far
            // must not be queued twice. Written before `stopped`, which it reads.
            queued_groups_ = next;
            throw;
          }
          next += 1;
        }
        if (state != checking) {
          queued_groups_ = next;
          return state;
        }
        std::this_thread::yield();
      }
    }

    size_t queued_groups() const { return queued_groups_; }

    // A deferred copy, in the calling thread: the staging slots its packs will use,
    // so the copy worker allocates nothing (an allocation may fail, or take the GIL
    // when the allocator records Python stacks).
    void reserve_slots() {
      int64_t packed = 0, largest = 0;
      for (const auto& group : r_.groups_) {
        if (!group.packed) continue;
        packed += 1;
        largest = std::max(largest, group.bytes);
      }
      const c10::Stream pack = pack_stream(device_);
      for (int64_t slot = 0; slot < std::min<int64_t>(packed, kSlots); ++slot) {
        ensure_slot(static_cast<int>(slot), largest, pack);
      }
    }

    // The staging slots, once the packs are queued: recorded on the copy stream,
    // so their memory returns to the pack stream's pool only after the DMAs.
    void release_slots() {
      for (auto& slot : slots_) slot.reset();
    }

    void end_timing() {
      if (!options_.timing) return;
      if (!on_device_) {
        r_.timer_->stop_host_clock(host_start_);
        return;
      }
      record_timing(r_.timer_->end, *stream_);
    }

    void finish_views(bool into_out, const std::shared_ptr<Transfer>& reuse) {
      if (into_out) return;
      if (reuse) {
        for (size_t i = 0; i < n_; ++i) {  // tensors in no group (empty ones) were not checked yet
          if (!prepared_[i].base.defined()) {
            check_source("offload.copy_to_host", i, tensors_[i], tensors_[0].device().type(), tensors_[0]);
            TORCH_CHECK_VALUE(tensors_[i].numel() == 0 && (*reuse->outputs_)[i].sizes() == tensors_[i].sizes(),
                              "offload.copy_to_host: out (a CopyHandle) was made for tensors[", i, "] with ",
                              describe((*reuse->host_bases_)[i]), " but tensors[", i, "] now has ",
                              describe(tensors_[i]));
          }
        }
        r_.source_keys_ = reuse->source_keys_;  // its host tensors are the handle's (adopt_groups or run_into)
        // Every source passed its checks: the buffers' new origin. With same_sources
        // each was compared equal to it already.
        auto* keys = r_.source_keys_.get();
        if (keys != nullptr && !options_.same_sources) {
          for (const auto& group : r_.groups_) {
            for (int64_t i : group.members) {
              keys->data[i].store(reinterpret_cast<uintptr_t>(tensors_[i].const_data_ptr()), std::memory_order_relaxed);
            }
          }
        }
        return;
      }
      record_source_keys();
      for (const auto& group : r_.groups_) {
        if (!group.packed) continue;
        for (size_t k = 0; k < group.members.size(); ++k) {
          const int64_t i = group.members[k];
          (*r_.host_bases_)[i] = view_like(group.host_block.storage(), group.offsets[k], prepared_[i].base,
                                        c10::Device(at::kCPU));
        }
      }
      for (size_t i = 0; i < n_; ++i) {
        const at::Tensor& base = prepared_[i].base;
        if (!(*r_.host_bases_)[i].defined()) {  // empty tensors: nothing to move
          (*r_.host_bases_)[i] = at::empty_strided(base.sizes(), base.strides(), base.options().device(at::kCPU));
        }
        const at::Tensor& host = (*r_.host_bases_)[i];
        (*r_.outputs_)[i] = prepared_[i].expanded ? host.expand(tensors_[i].sizes()) : host;
      }
    }

   private:
    // A fresh copy: what each source was (Transfer::SourceKeys), for refills.
    void record_source_keys() {
      auto keys = std::make_shared<Transfer::SourceKeys>(n_);
      for (size_t i = 0; i < n_; ++i) {
        const Prepared& p = prepared_[i];
        if (!p.base.defined()) continue;  // not prepared: nothing to record
        const at::Tensor& t = tensors_[i];
        auto& key = keys->keys[i];
        // Its host base has its strides: a refill with the same sizes matches it only if contiguous too.
        key.plain = t.is_contiguous() && !p.expanded && !p.made_contiguous && !p.resolved && p.nbytes > 0 &&
                    p.base.is_same(t);
        key.dtype = t.scalar_type();
        key.sizes_at = static_cast<int64_t>(keys->sizes.size());
        key.ndim = t.dim();
        keys->sizes.insert(keys->sizes.end(), t.sizes().begin(), t.sizes().end());
        keys->data[i].store(reinterpret_cast<uintptr_t>(t.const_data_ptr()), std::memory_order_relaxed);
      }
      r_.source_keys_ = std::move(keys);
    }

    // Makes `waiter` wait for the caller's work up to the call: the snapshot
    // event of a deferred copy, else the caller's stream as it is now.
    void wait_for_caller(const c10::Stream& waiter) {
      if (snapshot_ != nullptr) {
        snapshot_->block(waiter);
      } else {
        order_after(waiter, *caller_);
      }
    }

    // Timing starts after the wait for the caller, so it counts the copies only.
    void start_timing() {
      if (!options_.timing) return;
      if (!on_device_) {
        host_start_ = std::chrono::steady_clock::now();
        return;
      }
      record_timing(r_.timer_->start, *stream_);
    }

    // Prepares the members of `group` and checks them against the handle `reuse`.
    // A member copied as it was (SourceKeys::Key::plain) that still is, with the
    // same dtype and sizes, is its own base: checked without reading its host
    // tensor. Any other is prepared as a fresh copy prepares it and compared with
    // its host base. `deferred`: false, before any kernel, where one needs a new
    // tensor (the synchronous path makes it on the copy stream).
    bool check_reused(const Transfer::Group& group, const Transfer& reuse, bool deferred) {
      const char* fn = "offload.copy_to_host";
      const Transfer::SourceKeys* keys = reuse.source_keys_.get();
      const c10::DeviceType type = tensors_[0].device().type();
      for (int64_t i : group.members) {
        if (prepared_[i].base.defined()) continue;  // checked by an earlier call (see check_group)
        const at::Tensor& t = tensors_[i];
        check_source(fn, static_cast<size_t>(i), t, type, tensors_[0]);
        const Transfer::SourceKeys::Key* key = keys ? &keys->keys[i] : nullptr;
        if (key && key->plain && t.is_contiguous() && !t.is_conj() && !t.is_neg() && t.scalar_type() == key->dtype &&
            t.sizes().equals(c10::IntArrayRef(keys->sizes.data() + key->sizes_at, key->ndim))) {
          prepared_[i].base = t;
          prepared_[i].nbytes = tensor_nbytes(t);
          r_.nbytes_ += prepared_[i].nbytes;
        } else {
          if (deferred && needs_new_tensor(t)) return false;
          prepare_checked_member(i);
          const at::Tensor& host = (*reuse.host_bases_)[i];
          TORCH_CHECK_VALUE(same_layout(host, prepared_[i].base), fn, ": out (a CopyHandle) was made for tensors[", i,
                            "] with ", describe(host), " and strides ", host.strides(), " but tensors[", i,
                            "] now has ", describe(prepared_[i].base), " and strides ", prepared_[i].base.strides());
        }
        if (options_.same_sources) {
          const auto was = keys ? keys->data[i].load(std::memory_order_relaxed) : uintptr_t(0);
          const auto now = reinterpret_cast<uintptr_t>(t.const_data_ptr());
          TORCH_CHECK_VALUE(was == now, fn, ": same_sources=True, but tensors[", i, "] is at ",
                            reinterpret_cast<const void*>(now), " while the buffers of out (a CopyHandle) were last "
                            "filled from ", reinterpret_cast<const void*>(was));
        }
      }
      return true;
    }

    int64_t prepare_member(int64_t i) {
      check_source("offload.copy_to_host", static_cast<size_t>(i), tensors_[i], tensors_[0].device().type(),
                   tensors_[0]);
      return prepare_checked_member(i);
    }

    // prepare_member for a source check_source has passed.
    int64_t prepare_checked_member(int64_t i) {
      prepared_[i] = prepare(tensors_[i], /*allow_contiguous=*/true);
      if (prepared_[i].made_contiguous && !prepared_[i].resolved) {
        if (r_.restore_.empty()) r_.restore_.resize(n_);  // sized on first use: most copies have none
        r_.restore_[i] = Transfer::Strides(tensors_[i].sizes().vec(), tensors_[i].strides().vec());
      }
      if (prepared_[i].made_contiguous || prepared_[i].resolved) {  // a new tensor, made on the copy stream
        r_.keepalive_.push_back(prepared_[i].base);
        unsynced_prepared_work_ = true;
      }
      r_.nbytes_ += prepared_[i].nbytes;
      return prepared_[i].nbytes;
    }

    // Members are prepared while the copy stream is current, so a contiguous()
    // copy or a conj/neg resolution made for one ran there: the copy stream reads
    // the result in order (a direct group needs nothing), the pack stream must wait
    // for it before packing it. Called before each pack, once pack_ exists.
    void sync_prepared_work() {
      if (!unsynced_prepared_work_) return;
      order_after(*pack_, *stream_);
      unsynced_prepared_work_ = false;
    }

    void enqueue(Transfer::Group& group) {
      if (!group.host_block.defined()) group.host_block = pool_.allocate(static_cast<size_t>(group.bytes));
      if (group.packed) {
        enqueue_packed(group);
      } else {  // read on the copy stream, where its member was prepared: in order
        const int64_t i = group.members[0];
        if (!(*r_.host_bases_)[i].defined()) {
          (*r_.host_bases_)[i] = view_like(group.host_block.storage(), 0, prepared_[i].base, c10::Device(at::kCPU));
        }
        copy_bytes((*r_.host_bases_)[i], prepared_[i].base, options_.chunk_bytes, device_);
      }
      finish(group);
    }

    void enqueue_packed(Transfer::Group& group) {
      std::vector<ByteRange> ranges;
      ranges.reserve(group.members.size());
      if (!on_device_) {  // host to host: straight into the block
        char* target = static_cast<char*>(group.host_block.data_ptr());
        for (size_t k = 0; k < group.members.size(); ++k) {
          const Prepared& p = prepared_[group.members[k]];
          ranges.push_back({p.base.const_data_ptr(), target + group.offsets[k], p.nbytes});
        }
        multi_tensor_copy(ranges, device_);
        return;
      }
      if (!pack_) {
        pack_ = pack_stream(device_);
        wait_for_caller(*pack_);
      }
      sync_prepared_work();
      const int slot = packed_groups_ % kSlots;
      ensure_slot(slot, group.bytes, *pack_);
      if (packed_groups_ >= kSlots) r_.events_[slot_events_[slot]].block(*pack_);  // the DMA that read it
      char* target = static_cast<char*>(slots_[slot].data_ptr());
      for (size_t k = 0; k < group.members.size(); ++k) {
        const Prepared& p = prepared_[group.members[k]];
        ranges.push_back({p.base.const_data_ptr(), target + group.offsets[k], p.nbytes});
      }
      {
        c10::StreamGuard on_pack(*pack_);
        multi_tensor_copy(ranges, device_);
      }
      // One event, re-recorded per group: the copy stream's wait takes the record
      // current at the time of the wait, and no create/destroy per group.
      if (!packed_.has_value()) packed_.emplace(take_event(device_));
      packed_->record(*pack_);
      packed_->block(*stream_);
      copy_bytes_async(group.host_block.data_ptr(), true, target, false, group.bytes, device_);
      slot_events_[slot] = static_cast<int32_t>(r_.events_.size());  // finish() records it next
      packed_groups_ += 1;
    }

    // Staging slot `slot` holds at least `bytes`. A handle's groups (out=<handle>)
    // may have been made with a larger group_bytes than this call's: a slot grows
    // to the group it must hold.
    void ensure_slot(int slot, int64_t bytes, const c10::Stream& pack) {
      if (slots_[slot].defined() && slots_[slot].numel() >= bytes) return;
      // Allocated on the pack stream, which writes it, and recorded on the copy
      // stream, whose DMAs read it: freed, the block returns to the pack stream's
      // pool only after those DMAs, so the next transfer's pack cannot overwrite
      // a slot this one's DMA still reads (allocated on the copy stream, it was
      // reusable by the next transfer's pack as soon as this one's packs ended).
      const int64_t size = std::max(group_limit(options_), bytes);
      {
        c10::StreamGuard on_pack(pack);
        slots_[slot] = at::empty({size}, at::TensorOptions().dtype(at::kByte).device(device_));
      }
      slots_[slot].record_stream(*stream_);
    }

    void finish(const Transfer::Group& group) {
      if (!on_device_) return;
      pool_.record_stream(group.host_block, *stream_);
      r_.mark_complete(*stream_, group.members);
    }

    // Caller-owned destinations of any layout: one copy each, an event every chunk_bytes.
    void run_into(const std::vector<at::Tensor>& out) {
      std::vector<int64_t> members;
      int64_t pending = 0;
      for (size_t i = 0; i < n_; ++i) {
        prepared_[i] = prepare(tensors_[i], /*allow_contiguous=*/false);
        const at::Tensor& dst = out[i];
        const at::Tensor& base = prepared_[i].base;
        if (is_dense(dst) && is_dense(base) && same_layout(dst, base)) {
          copy_bytes(dst, base, options_.chunk_bytes, device_);
        } else if (prepared_[i].nbytes > 0) {
          dst.copy_(tensors_[i], /*non_blocking=*/true);
        }
        // Pool blocks are held back by the pool's events; other host memory by a reference.
        if (on_device_ && !pool_.record_stream(dst, *stream_)) r_.keepalive_.push_back(dst);
        (*r_.outputs_)[i] = (*r_.host_bases_)[i] = dst;
        r_.nbytes_ += prepared_[i].nbytes;
        members.push_back(static_cast<int64_t>(i));
        pending += prepared_[i].nbytes;
        if (on_device_ && (pending >= options_.chunk_bytes || i + 1 == n_)) {
          r_.mark_complete(*stream_, members);
          members.clear();
          pending = 0;
        }
      }
    }

    TensorSource& tensors_;
    HostPool& pool_;
    const c10::optional<c10::Stream>& stream_;
    const CopyOptions& options_;
    Transfer& r_;
    const bool on_device_;
    const c10::Device device_;
    const size_t n_;
    std::vector<Prepared> prepared_;
    c10::OptionalDeviceGuard device_guard_;
    c10::optional<c10::StreamGuard> stream_guard_;
    c10::optional<c10::Stream> caller_;
    c10::optional<c10::Stream> pack_;
    c10::optional<c10::Event> packed_;  // recorded on pack_ after each group's pack
    at::Tensor slots_[kSlots];
    int32_t slot_events_[kSlots] = {-1, -1, -1};
    int64_t packed_groups_ = 0;
    bool unsynced_prepared_work_ = false;
    const c10::Event* snapshot_ = nullptr;  // a deferred copy's snapshot (its job owns it)
    size_t queued_groups_ = 0;              // a deferred copy: groups queued (by the caller, then the worker)
    std::chrono::steady_clock::time_point host_start_;
  };

  // A deferred copy's job: owns what the copy worker needs until the copies are
  // queued (transfer.h says who owns what). Members that ToHost refers to are
  // declared before it and never move (the job lives on the heap).
  //
  // Handoff: the calling thread checks the sources group by group and publishes
  // its count (`checked`); the worker queues each group below it. The caller
  // then sets `handoff`: kComplete (every group checked, every source
  // converted: the worker queues the rest, then takes the sources and frees the
  // slots), or kTakenBack (a source failed its check or needs a new tensor: the
  // worker stops, says so in `stopped`, and leaves the rest to the caller).
  struct DeferredToHost final : DeferredWork {
    static constexpr int kChecking = 0, kComplete = 1, kTakenBack = 2;

    DeferredToHost(std::unique_ptr<TensorSource> tensors, std::shared_ptr<HostPool> pool_,
                   const c10::optional<c10::Stream>& stream_, const CopyOptions& options_, const c10::Device& device)
        : source(std::move(tensors)), pool(std::move(pool_)), stream(stream_),
          options(options_), result(std::make_shared<Transfer>(device)),
          plan(std::make_unique<ToHost>(*source, *pool, stream, options, *result, /*on_device=*/true)) {}

    std::exception_ptr run() noexcept override {
      std::exception_ptr error;
      int how = kChecking;
      try {
        how = plan->follow_checks(checked, handoff, kChecking);
      } catch (...) {
        error = std::current_exception();
        // Nothing more is queued; the plan stays the caller's until it hands off.
        while ((how = handoff.load(std::memory_order_acquire)) == kChecking) std::this_thread::yield();
      }
      if (how == kTakenBack) {
        stopped.store(true, std::memory_order_release);
        return error;  // the caller queues the rest and owns the sources, snapshot and slots
      }
      try {
        plan->end_timing();
        // Moved, not copied: the worker changes no reference count it could
        // take to zero. Copies already queued keep their sources, as in to_host.
        Transfer& r = *result;
        std::vector<at::Tensor> sources = source->take();  // converted by the caller (to_host_deferred)
        r.keepalive_.insert(r.keepalive_.end(), std::make_move_iterator(sources.begin()),
                            std::make_move_iterator(sources.end()));
        r.release_keepalive(stream, /*drain=*/false);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
      give_back_event(std::move(*snapshot));
      plan->release_slots();
      return error;
    }

    // In the calling thread, once submitted: stops the worker after the groups
    // queued so far and waits until it has (it is at work on this job: the
    // caller waited for it to be idle before submitting).
    void take_back() {
      handoff.store(kTakenBack, std::memory_order_release);
      while (!stopped.load(std::memory_order_acquire)) std::this_thread::yield();
    }

    std::shared_ptr<Transfer::Deferred> state() const override { return result->deferred_; }

    std::atomic<size_t> checked{1};  // groups the caller has checked (it queues the first)
    std::atomic<int> handoff{kChecking};
    std::atomic<bool> stopped{false};  // the worker let go of the plan (kTakenBack)
    std::unique_ptr<TensorSource> source;  // every tensor converted before the worker takes them
    std::shared_ptr<HostPool> pool;
    c10::optional<c10::Stream> stream;
    CopyOptions options;
    std::shared_ptr<Transfer> result;
    std::unique_ptr<ToHost> plan;
    c10::optional<c10::Event> snapshot;  // recorded on the caller's stream at the call
  };

  // One host-to-device transfer, enqueued span by span. Small tensors of one
  // host storage that sit close together (as a packed block's do) form a span:
  // one device buffer, one DMA, a view per tensor. The copy stream first waits
  // for the caller's stream, so outputs allocated there afterwards are safe to write.
  class ToDevice {
   public:
    ToDevice(TensorSource& tensors, const std::shared_ptr<Transfer>& from,
             const c10::Device& device, HostPool& pool, const c10::optional<c10::Stream>& stream,
             const c10::optional<std::vector<at::Tensor>>& out, const CopyOptions& options, Transfer& r)
        : tensors_(tensors), from_(from), device_(device), pool_(pool), stream_(stream), out_(out),
          options_(options), r_(r), on_device_(!tensors.empty() && !device.is_cpu()), n_(tensors.size()),
          prepared_(n_) {
      r_.outputs_->resize(n_);
      r_.restore_.resize(n_);
      r_.event_of_.assign(n_, -1);
    }

    void run() {
      if (options_.timing) r_.timer_ = std::make_shared<CopyTimer>();
      if (from_ && !on_device_) from_->synchronize();
      if (on_device_) {
        device_guard_.reset_device(device_);
        order_after(*stream_, current_stream(device_));
        if (from_) from_->wait_stream(*stream_);
        if (options_.timing) record_timing(r_.timer_->start, *stream_);  // after the waits: the copies only
      }
      const auto host_start = std::chrono::steady_clock::now();
      enqueue_all();
      if (options_.timing) {
        if (on_device_) {
          record_timing(r_.timer_->end, *stream_);
        } else {
          r_.timer_->stop_host_clock(host_start);
        }
      }
    }

   private:
    void enqueue_all() {
      GroupSizes sizes(options_);
      Span span;
      for (size_t i = 0; i < n_; ++i) {
        check_member(i);
        Prepared& p = prepared_[i];
        p = prepare(tensors_[i], /*allow_contiguous=*/false);
        if (!is_dense(p.base)) {
          if (from_) from_->synchronize();  // a host-side copy must see the finished transfer
          p.base = p.base.contiguous();
        }
        r_.nbytes_ += p.nbytes;
        const int64_t idx = static_cast<int64_t>(i);
        if (p.nbytes == 0) {
          (*r_.outputs_)[i] = out_ ? (*out_)[i]
                                   : finish_output(idx, at::empty_strided(p.base.sizes(), p.base.strides(),
                                                                          p.base.options().device(device_)));
          continue;
        }
        const void* storage = p.base.storage().data();
        const int64_t offset = p.base.storage_offset() * static_cast<int64_t>(p.base.element_size());
        if (p.nbytes >= options_.small_bytes) {
          Span single;
          single.storage = storage;
          single.storage_offset = offset;
          single.bytes = p.nbytes;
          single.members.push_back(idx);
          single.offsets.push_back(0);
          enqueue(single);
          continue;
        }
        const int64_t end = span.storage_offset + span.bytes;
        const bool joins = !span.members.empty() && storage == span.storage && offset >= end &&
                           offset - end <= kMaxSpanGap && offset + p.nbytes - span.storage_offset <= sizes.current() &&
                           (offset - span.storage_offset) % kAlign == 0;
        if (!joins) {
          if (!span.members.empty()) {
            enqueue(span);
            sizes.next();
          }
          span = Span();
          span.storage = storage;
          span.storage_offset = offset;
        }
        span.members.push_back(idx);
        span.offsets.push_back(offset - span.storage_offset);
        span.bytes = std::max(span.bytes, offset + p.nbytes - span.storage_offset);
      }
      if (!span.members.empty()) enqueue(span);
    }

    struct Span {
      const void* storage = nullptr;
      std::vector<int64_t> members;
      std::vector<int64_t> offsets;  // byte offset of each member from the span's start
      int64_t storage_offset = 0;    // byte offset of the span in its host storage
      int64_t bytes = 0;
    };

    void check_member(size_t i) {
      const char* fn = "offload.copy_to_device";
      const at::Tensor& t = tensors_[i];
      if (!out_) check_source(fn, i, t, c10::DeviceType::CPU, tensors_[0]);  // with out=, to_device checked it
      if (on_device_ && options_.require_pinned && !from_ && t.numel() > 0) {
        TORCH_CHECK_VALUE(is_pinned(t), fn, ": tensors[", i, "] is not pinned, so the copy would block the host; "
                          "pass pinned memory (offload.copy_to_host results, offload.HostPool.empty, "
                          "tensor.pin_memory()) or require_pinned=False");
      }
    }

    // Asking the driver whether memory is pinned costs ~1 us, so ask once per storage.
    bool is_pinned(const at::Tensor& t) {
      const void* key = t.storage().data();
      auto it = pinned_storages_.find(key);
      if (it == pinned_storages_.end()) it = pinned_storages_.emplace(key, pool_.owns(t) || t.is_pinned()).first;
      return it->second;
    }

    at::Tensor finish_output(int64_t i, at::Tensor target) {
      const Prepared& p = prepared_[i];
      if (from_ && from_->restore_.size() == n_ && from_->restore_[i]) {
        const auto& spec = *from_->restore_[i];
        at::Tensor restored = at::empty_strided(spec.first, spec.second, p.base.options().device(device_));
        c10::optional<c10::StreamGuard> on_copy;
        if (on_device_) on_copy.emplace(*stream_);
        restored.copy_(target, /*non_blocking=*/true);
        if (on_device_) restored.record_stream(*stream_);
        return restored;
      }
      return p.expanded ? target.expand(tensors_[i].sizes()) : target;
    }

    void enqueue(Span& span) {
      const at::Tensor& first = prepared_[span.members[0]].base;
      const char* host = static_cast<const char*>(first.storage().data()) + span.storage_offset;
      if (!out_) {
        // Allocated on the caller's (consumer's) stream, which is current here.
        at::Tensor buffer = at::empty({span.bytes}, at::TensorOptions().dtype(at::kByte).device(device_));
        if (on_device_) buffer.record_stream(*stream_);  // written there, even if every view of it dies mid-copy
        {
          c10::optional<c10::StreamGuard> on_copy;
          if (on_device_) on_copy.emplace(*stream_);
          copy_chunked(static_cast<char*>(buffer.data_ptr()), false, host, true, span.bytes, options_.chunk_bytes,
                       device_);
        }
        for (size_t k = 0; k < span.members.size(); ++k) {
          const int64_t i = span.members[k];
          (*r_.outputs_)[i] =
              finish_output(i, view_like(buffer.storage(), span.offsets[k], prepared_[i].base, device_));
        }
      } else {
        c10::optional<c10::StreamGuard> on_copy;
        if (on_device_) on_copy.emplace(*stream_);
        const int64_t i0 = span.members[0];
        const at::Tensor& target0 = (*out_)[i0];
        if (span.members.size() == 1 && is_dense(target0) && same_layout(target0, first)) {
          copy_bytes(target0, first, options_.chunk_bytes, device_);
        } else {
          // Into caller-owned tensors: DMA the span into staging (allocated on the
          // copy stream, which owns it), then one multi-tensor copy scatters it.
          at::Tensor staging = at::empty({span.bytes}, at::TensorOptions().dtype(at::kByte).device(device_));
          copy_bytes_async(staging.data_ptr(), false, host, true, span.bytes, device_);
          std::vector<ByteRange> ranges;
          for (size_t k = 0; k < span.members.size(); ++k) {
            const int64_t i = span.members[k];
            const at::Tensor& target = (*out_)[i];
            at::Tensor view = view_like(staging.storage(), span.offsets[k], prepared_[i].base, device_);
            if (same_layout(target, view) && is_dense(target)) {
              ranges.push_back({view.data_ptr(), target.data_ptr(), tensor_nbytes(view)});
            } else {
              target.copy_(prepared_[i].expanded ? view.expand(tensors_[i].sizes()) : view, /*non_blocking=*/true);
            }
          }
          multi_tensor_copy(ranges, device_);  // staging: allocated and used on the copy stream only
        }
        for (int64_t i : span.members) {
          (*r_.outputs_)[i] = (*out_)[i];
          // Written on the copy stream but owned by the caller's: held until the
          // copies complete, so dropping them (and the handle) early cannot give
          // their memory to the caller's stream while the DMA still writes it.
          if (on_device_) r_.keepalive_.push_back((*out_)[i]);
        }
      }
      if (on_device_) {
        // Pool blocks are held back by the pool's events; other host memory by a reference.
        if (!pool_.record_stream(first, *stream_)) r_.keepalive_.push_back(first);
        r_.mark_complete(*stream_, span.members);
      }
    }

    TensorSource& tensors_;
    const std::shared_ptr<Transfer>& from_;
    const c10::Device device_;
    HostPool& pool_;
    const c10::optional<c10::Stream>& stream_;
    const c10::optional<std::vector<at::Tensor>>& out_;
    const CopyOptions& options_;
    Transfer& r_;
    const bool on_device_;
    const size_t n_;
    std::vector<Prepared> prepared_;
    std::unordered_map<const void*, bool> pinned_storages_;
    c10::OptionalDeviceGuard device_guard_;
  };
};

std::shared_ptr<Transfer> copy_to_host(TensorSource& tensors, HostPool& pool,
                                       const c10::optional<c10::Stream>& stream,
                                       const c10::optional<std::vector<at::Tensor>>& out,
                                       const std::shared_ptr<Transfer>& out_transfer, const CopyOptions& options) {
  return CopyEngine::to_host(tensors, pool, stream, out, out_transfer, options);
}

std::shared_ptr<Transfer> copy_to_host(const std::vector<at::Tensor>& tensors, HostPool& pool,
                                       const c10::optional<c10::Stream>& stream,
                                       const c10::optional<std::vector<at::Tensor>>& out,
                                       const std::shared_ptr<Transfer>& out_transfer, const CopyOptions& options) {
  TensorSource source(tensors);
  return CopyEngine::to_host(source, pool, stream, out, out_transfer, options);
}

std::shared_ptr<Transfer> copy_to_host_deferred(std::unique_ptr<TensorSource> tensors, HostPool& pool,
                                                const c10::optional<c10::Stream>& stream,
                                                const std::shared_ptr<Transfer>& out_transfer,
                                                const CopyOptions& options, const std::function<void()>& converted) {
  return CopyEngine::to_host_deferred(std::move(tensors), pool, stream, out_transfer, options, converted);
}

std::shared_ptr<Transfer> copy_to_host_deferred(std::vector<at::Tensor> tensors, HostPool& pool,
                                                const c10::optional<c10::Stream>& stream,
                                                const std::shared_ptr<Transfer>& out_transfer,
                                                const CopyOptions& options) {
  return CopyEngine::to_host_deferred(TensorSource::owning(std::move(tensors)), pool, stream, out_transfer, options,
                                      {});
}

std::shared_ptr<Transfer> copy_spans_to_host(const std::vector<at::Tensor>& tensors,
                                             const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes,
                                             const at::Tensor& out, int64_t out_bytes,
                                             const std::vector<int64_t>& offsets, HostPool& pool,
                                             const c10::optional<c10::Stream>& stream, const CopyOptions& options) {
  return CopyEngine::spans_to_host(tensors, starts, sizes, out, out_bytes, offsets, pool, stream, options);
}

std::shared_ptr<Transfer> copy_to_device(TensorSource& tensors, const std::shared_ptr<Transfer>& from,
                                         const c10::Device& device, HostPool& pool,
                                         const c10::optional<c10::Stream>& stream,
                                         const c10::optional<std::vector<at::Tensor>>& out,
                                         const CopyOptions& options) {
  return CopyEngine::to_device(tensors, from, device, pool, stream, out, options);
}

std::shared_ptr<Transfer> copy_to_device(const std::vector<at::Tensor>& tensors,
                                         const std::shared_ptr<Transfer>& from, const c10::Device& device,
                                         HostPool& pool, const c10::optional<c10::Stream>& stream,
                                         const c10::optional<std::vector<at::Tensor>>& out,
                                         const CopyOptions& options) {
  TensorSource source(tensors);
  return CopyEngine::to_device(source, from, device, pool, stream, out, options);
}

namespace {

namespace py = pybind11;

// The lines of a tensor the conversion and the copy engine's checks read: its
// reference count, sizes, strides, dtype and device (TensorImpl spans ~4 lines).
inline void prefetch_tensor(const c10::TensorImpl* impl) {
  const char* p = reinterpret_cast<const char*>(impl);
  for (size_t line = 0; line < sizeof(c10::TensorImpl); line += 64) prefetch(p + line);
}

// Items ahead of the one converted, by stage: its Python object, then its
// TensorImpl (read through the object), then its StorageImpl (read through the
// TensorImpl, for the data pointer). After a training step these are cache
// misses, one chain of three per tensor: asked for early, the misses of several
// tensors overlap instead of queueing. With the checks right behind the
// conversion (to_host_deferred), converting and checking the 3,744 sources of a
// 4,000-tensor refill after its head took 0.60 ms instead of 0.96 ms there.
constexpr size_t kObjectAhead = 12, kTensorAhead = 8, kStorageAhead = 4;

void prefetch_ahead(PyObject* items, size_t i, size_t size) {
  if (i + kObjectAhead < size) prefetch(PyList_GET_ITEM(items, static_cast<Py_ssize_t>(i + kObjectAhead)));
  if (i + kTensorAhead < size) {
    PyObject* item = PyList_GET_ITEM(items, static_cast<Py_ssize_t>(i + kTensorAhead));
    if (THPVariable_CheckExact(item)) prefetch_tensor(THPVariable_Unpack(item).unsafeGetTensorImpl());
  }
  if (i + kStorageAhead < size) {
    PyObject* item = PyList_GET_ITEM(items, static_cast<Py_ssize_t>(i + kStorageAhead));
    if (THPVariable_CheckExact(item)) {
      const c10::TensorImpl* impl = THPVariable_Unpack(item).unsafeGetTensorImpl();
      prefetch(impl->unsafe_storage().unsafeGetStorageImpl());  // null without storage: harmless
    }
  }
}

// Converts list items to tensors on demand, taking the GIL for each batch. The
// list outlives the call (the binding's argument holds it), so it is borrowed.
TensorSource::Fill lazy_conversion(const py::list& list) {
  PyObject* items = list.ptr();
  return [items](std::vector<at::Tensor>& into, size_t upto) {
    py::gil_scoped_acquire gil;
    const auto size = static_cast<size_t>(PyList_GET_SIZE(items));
    TORCH_CHECK_VALUE(size >= upto, "offload: the list of tensors changed size during the copy");
    for (size_t i = into.size(); i < upto; ++i) {
      prefetch_ahead(items, i, size);
      PyObject* item = PyList_GET_ITEM(items, static_cast<Py_ssize_t>(i));
      if (!THPVariable_Check(item)) {
        throw py::type_error("offload: tensors[" + std::to_string(i) + "] must be a torch.Tensor, got " +
                             Py_TYPE(item)->tp_name);
      }
      into.push_back(THPVariable_Unpack(item));
    }
  };
}

// Drops what the copy worker finished and the in-flight registry no longer
// needs, here, with the GIL held: a dropped tensor that has a Python object takes
// the GIL, which costs little when held and, released, may wait for another
// thread's switch interval, per tensor. Bindings call it before they let the GIL
// go, so the engine's own drains (without it) find little left.
void collect_with_gil() {
  CopyWorker::instance().collect();
  InFlight::instance().drain();
}

// A deferred transfer not queued yet is waited for without the GIL (the worker
// never needs it, but other Python threads should run meanwhile).
void settle_deferred(const Transfer& t) {
  if (t.enqueue_pending()) {
    py::gil_scoped_release no_gil;
    t.wait_enqueued();
  }
  if (t.deferred()) collect_with_gil();
}

void bind_copy_engine(py::module_& m) {
  py::class_<Transfer, std::shared_ptr<Transfer>>(m, "Transfer")
      .def("tensors", &Transfer::tensors)
      // One tensor, or the count, without converting the whole list (thousands of tensors).
      .def("size", [](const Transfer& t) { return t.tensors().size(); })
      .def("tensor",
           [](const Transfer& t, int64_t i) {
             const auto n = static_cast<int64_t>(t.tensors().size());
             TORCH_CHECK_INDEX(i >= 0 && i < n, "offload.CopyHandle: index ", i, " out of range for ", n, " tensors");
             return t.tensors()[i];
           })
      .def("nbytes", &Transfer::nbytes)
      .def("device", &Transfer::device)
      .def("restore_specs", &Transfer::restore_specs)
      // Each waits without the GIL and drains the registry with it (Transfer::query says why).
      .def("query",
           [](const Transfer& t) {
             if (t.enqueue_pending()) return false;  // never waits: not even queued yet
             settle_deferred(t);
             bool done = false;
             {
               py::gil_scoped_release no_gil;
               done = t.query(/*drain=*/false);
             }
             if (done) InFlight::instance().drain();
             return done;
           })
      .def("synchronize",
           [](const Transfer& t) {
             settle_deferred(t);
             {
               py::gil_scoped_release no_gil;
               t.synchronize(/*drain=*/false);
             }
             InFlight::instance().drain();
           })
      // stream None: the current stream of the transfer's device.
      .def("wait_stream",
           [](const Transfer& t, c10::optional<c10::Stream> s) {
             settle_deferred(t);
             t.wait_stream(s);
           })
      .def("wait_stream_for",
           [](const Transfer& t, int64_t i, c10::optional<c10::Stream> s) {
             settle_deferred(t);
             t.wait_stream_for(i, s);
           })
      .def("release_sources",
           [](Transfer& t, c10::optional<c10::Stream> s) {
             settle_deferred(t);
             t.release_sources(s);
           })
      .def("copy_seconds", &Transfer::copy_seconds)  // never waits
      .def("timer", [](const Transfer& t) {
        settle_deferred(t);
        return t.timer();
      });
  py::class_<CopyTimer, std::shared_ptr<CopyTimer>>(m, "CopyTimer")
      .def("seconds", &CopyTimer::seconds)  // never waits
      .def("synchronize", &CopyTimer::synchronize, py::call_guard<py::gil_scoped_release>());
  auto make_options = [](bool require_pinned, int64_t small_bytes, int64_t chunk_bytes) {
    CopyOptions o;
    o.require_pinned = require_pinned;
    o.small_bytes = small_bytes;
    o.chunk_bytes = chunk_bytes;
    return o;
  };
  // `tensors` is a Python list, converted as the engine reaches it (with the GIL
  // taken for each batch); copy_to_device also takes None for "the tensors of `from`".
  m.def("copy_to_host",
        [make_options](const py::list& tensors, HostPool& pool, c10::optional<c10::Stream> stream,
                       c10::optional<std::vector<at::Tensor>> out, std::shared_ptr<Transfer> reuse,
                       bool require_pinned, int64_t small_bytes, int64_t chunk_bytes, int64_t group_bytes,
                       bool defer, bool timing, bool same_sources) {
          CopyOptions options = make_options(require_pinned, small_bytes, chunk_bytes);
          options.group_bytes = group_bytes;
          options.timing = timing;
          options.same_sources = same_sources;
          if (defer) {
            TORCH_CHECK_VALUE(!out.has_value(), "offload.copy_to_host: defer=True takes out=<CopyHandle>, "
                              "not a list of tensors");
            collect_with_gil();  // what earlier copies left, before the GIL is let go
            // Converted with the GIL held until every tensor is (the worker never
            // takes it): the first groups are queued after converting their own
            // tensors only, and each later batch is checked as it is converted.
            // Let go once, not per batch: taken back per batch, it could wait a
            // switch interval each time for another Python thread.
            auto source = std::make_unique<TensorSource>(tensors.size(), lazy_conversion(tensors));
            c10::optional<py::gil_scoped_release> no_gil;
            return copy_to_host_deferred(std::move(source), pool, stream, reuse, options,
                                         [&no_gil] { no_gil.emplace(); });
          }
          collect_with_gil();  // what earlier copies left, before the GIL is let go
          TensorSource source(tensors.size(), lazy_conversion(tensors));
          py::gil_scoped_release no_gil;
          return copy_to_host(source, pool, stream, out, reuse, options);
        });
  // Registered with atexit by the first deferred copy: copies still being queued
  // are queued before the interpreter (and then the driver) goes away.
  m.def("wait_copy_worker", [] {
    py::gil_scoped_release no_gil;
    CopyWorker::instance().wait_idle();
  });
  // out None: the core acquires a block of out_bytes from the pool.
  m.def("copy_spans_to_host",
        [make_options](const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& starts,
                       const std::vector<int64_t>& sizes, c10::optional<at::Tensor> out, int64_t out_bytes,
                       const std::vector<int64_t>& offsets, HostPool& pool, c10::optional<c10::Stream> stream,
                       int64_t chunk_bytes, bool timing) {
          collect_with_gil();
          py::gil_scoped_release no_gil;
          auto options = make_options(true, 0, chunk_bytes);
          options.timing = timing;
          return copy_spans_to_host(tensors, starts, sizes, out.value_or(at::Tensor()), out_bytes, offsets, pool,
                                    stream, options);
        });
  m.def("copy_to_device",
        [make_options](const py::object& tensors, std::shared_ptr<Transfer> from, c10::Device device,
                       HostPool& pool, c10::optional<c10::Stream> stream, c10::optional<std::vector<at::Tensor>> out,
                       bool require_pinned, int64_t small_bytes, int64_t chunk_bytes, bool timing) {
          TORCH_CHECK_VALUE(!tensors.is_none() || from, "offload.copy_to_device: tensors is None and no transfer given");
          c10::optional<TensorSource> given;
          if (!tensors.is_none()) {
            const auto list = tensors.cast<py::list>();
            given.emplace(list.size(), lazy_conversion(list));
          }
          collect_with_gil();
          py::gil_scoped_release no_gil;
          auto options = make_options(require_pinned, small_bytes, chunk_bytes);
          options.timing = timing;
          if (given) return copy_to_device(*given, from, device, pool, stream, out, options);
          return copy_to_device(from->tensors(), from, device, pool, stream, out, options);
        });
}

}  // namespace

OFFLOAD_REGISTER_BINDINGS(b_copy_engine, bind_copy_engine);

}  // namespace offload
