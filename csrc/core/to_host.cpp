// Device to host, synchronously queued: CopyEngine::to_host and the plan it runs
// (CopyEngine::ToHost, to_host_plan.h), which the deferred copy shares.
//
// Moves: the bytes of strided tensors of one device into pooled host blocks. A
// small tensor (< small_bytes) is packed with others into a device staging slot
// at a 16-byte aligned offset, then one DMA moves the slot's bytes into one host
// block; a large one moves by itself in chunk_bytes pieces. Layout: each source
// moves as its compact dense base (broadcast dimensions narrowed); a gapped
// source is first made contiguous on the copy stream, and its sizes and strides
// kept so the copy back restores them (Transfer::restore_specs). Limits: one
// device per call; sources that need a new tensor (gapped, conj/neg views) cost a
// kernel each; staging holds kSlots slots of group_limit() bytes while a copy runs.
#include "to_host_plan.h"

#include <algorithm>
#include <thread>

#include "copy_worker.h"
#include "offload/checks.h"
#include "offload/event_cache.h"
#include "offload/multi_tensor_copy.h"
#include "offload/tensor_layout.h"

namespace offload {

std::shared_ptr<Transfer> CopyEngine::to_host(TensorSource& tensors, HostPool& pool,
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

CopyEngine::ToHost::ToHost(TensorSource& tensors, HostPool& pool, const c10::optional<c10::Stream>& stream,
                           const CopyOptions& options, Transfer& r, bool on_device)
    : tensors_(tensors), pool_(pool), stream_(stream), options_(options), r_(r), on_device_(on_device),
      device_(r.device_), n_(tensors.size()), prepared_(n_) {
  r_.event_of_.assign(n_, -1);
  if (options.timing) r_.timer_ = std::make_shared<CopyTimer>();
}

CopyEngine::ToHost::~ToHost() {
  if (packed_) give_back_event(std::move(*packed_));
}

void CopyEngine::ToHost::run(const c10::optional<std::vector<at::Tensor>>& out,
                             const std::shared_ptr<Transfer>& reuse) {
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

size_t CopyEngine::ToHost::adopt_groups(const Transfer& reuse) {
  r_.groups_ = reuse.groups_;
  r_.outputs_ = reuse.outputs_;
  r_.host_bases_ = reuse.host_bases_;
  return r_.groups_.size();
}

bool CopyEngine::ToHost::check_group(size_t g, const Transfer& reuse, bool deferred) {
  return check_reused(r_.groups_[g], reuse, deferred);
}

void CopyEngine::ToHost::enqueue_here(size_t from, size_t to, const Transfer& reuse, size_t check_from) {
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

int CopyEngine::ToHost::follow_checks(const std::atomic<size_t>& checked, const std::atomic<int>& handoff,
                                      int checking) {
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

void CopyEngine::ToHost::reserve_slots() {
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

void CopyEngine::ToHost::release_slots() {
  for (auto& slot : slots_) slot.reset();
}

void CopyEngine::ToHost::end_timing() {
  if (!options_.timing) return;
  if (!on_device_) {
    r_.timer_->stop_host_clock(host_start_);
    return;
  }
  record_timing(r_.timer_->end, *stream_);
}

void CopyEngine::ToHost::finish_views(bool into_out, const std::shared_ptr<Transfer>& reuse) {
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

void CopyEngine::ToHost::record_source_keys() {
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

void CopyEngine::ToHost::wait_for_caller(const c10::Stream& waiter) {
  if (snapshot_ != nullptr) {
    snapshot_->block(waiter);
  } else {
    order_after(waiter, *caller_);
  }
}

void CopyEngine::ToHost::start_timing() {
  if (!options_.timing) return;
  if (!on_device_) {
    host_start_ = std::chrono::steady_clock::now();
    return;
  }
  record_timing(r_.timer_->start, *stream_);
}

bool CopyEngine::ToHost::check_reused(const Transfer::Group& group, const Transfer& reuse, bool deferred) {
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

int64_t CopyEngine::ToHost::prepare_member(int64_t i) {
  check_source("offload.copy_to_host", static_cast<size_t>(i), tensors_[i], tensors_[0].device().type(),
               tensors_[0]);
  return prepare_checked_member(i);
}

int64_t CopyEngine::ToHost::prepare_checked_member(int64_t i) {
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

void CopyEngine::ToHost::sync_prepared_work() {
  if (!unsynced_prepared_work_) return;
  order_after(*pack_, *stream_);
  unsynced_prepared_work_ = false;
}

void CopyEngine::ToHost::enqueue(Transfer::Group& group) {
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

void CopyEngine::ToHost::enqueue_packed(Transfer::Group& group) {
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
  if (packed_groups_ >= kSlots) r_.events_[slot_events_[slot]]->block(*pack_);  // the DMA that read it
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

void CopyEngine::ToHost::ensure_slot(int slot, int64_t bytes, const c10::Stream& pack) {
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

void CopyEngine::ToHost::finish(const Transfer::Group& group) {
  if (!on_device_) return;
  pool_.record_stream(group.host_block, *stream_, r_.mark_complete(*stream_, group.members));
}

void CopyEngine::ToHost::run_into(const std::vector<at::Tensor>& out) {
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

}  // namespace offload
