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
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/extension.h>

#include "offload/bindings_registry.h"
#include "offload/checks.h"
#include "offload/multi_tensor_copy.h"
#include "offload/tensor_layout.h"

namespace offload {
namespace {

constexpr int64_t kAlign = 16;                          // packed offsets: 16-byte vector copies
// One staging buffer and one DMA. 8 MiB already runs the DMA at ~97% of its
// peak, and smaller groups start the first DMA sooner after the call.
constexpr int64_t kMaxGroupBytes = int64_t(8) << 20;
constexpr int64_t kMaxSpanGap = int64_t(64) << 10;      // host gap worth reading to save a DMA

int64_t align_up(int64_t value) { return (value + kAlign - 1) / kAlign * kAlign; }

int64_t group_limit(const CopyOptions& options) {
  return std::max(options.small_bytes, std::min(options.chunk_bytes, kMaxGroupBytes));
}

c10::Stream current_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

std::string type_name(c10::DeviceType type) { return c10::DeviceTypeName(type, /*lower_case=*/true); }

void check_source(const char* fn, size_t i, const at::Tensor& t, c10::DeviceType expected, const at::Tensor& first) {
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

// Copies the bytes of dense `src` into dense `dst` (identical strides), in chunks,
// on the current stream of `device`.
void copy_bytes(const at::Tensor& dst, const at::Tensor& src, int64_t chunk_bytes, const c10::Device& device) {
  const int64_t nbytes = tensor_nbytes(src);
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  for (int64_t at = 0; at < nbytes; at += chunk_bytes) {
    copy_bytes_async(d + at, dst.is_cpu(), s + at, src.is_cpu(), std::min(chunk_bytes, nbytes - at), device);
  }
}

bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.strides() == b.strides() && a.scalar_type() == b.scalar_type();
}

}  // namespace

// Transfers whose copies are still running, kept referenced (and with them
// every tensor they read or write) until their last event completes, so the
// caching allocator cannot give that memory to anyone else mid-copy even if the
// caller drops the tensors and the handle at once. One reference per transfer
// replaces a record_stream per tensor, which cost ~1 us each in a 4096-tensor
// batch. Drained on every new transfer and on every query of one.
class InFlight {
 public:
  static InFlight& instance() {
    static InFlight* registry = new InFlight();  // never destroyed: it may hold CUDA tensors at exit
    return *registry;
  }
  void add(std::shared_ptr<Transfer> transfer) {
    std::lock_guard<std::mutex> lock(mutex_);
    drain_locked();
    if (!transfer->keepalive_.empty() || !transfer->events_.empty()) transfers_.push_back(std::move(transfer));
  }
  void drain() {
    std::lock_guard<std::mutex> lock(mutex_);
    drain_locked();
  }

 private:
  void drain_locked() {
    for (auto it = transfers_.begin(); it != transfers_.end();) {
      if ((*it)->events_.empty() || (*it)->events_.back().query()) {
        (*it)->keepalive_.clear();
        it = transfers_.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::mutex mutex_;
  std::deque<std::shared_ptr<Transfer>> transfers_;
};

bool Transfer::query() const {
  const bool done = events_.empty() || events_.back().query();
  if (done) InFlight::instance().drain();
  return done;
}

void Transfer::synchronize() const {
  if (!events_.empty()) events_.back().synchronize();
  InFlight::instance().drain();
}

void Transfer::wait_stream(const c10::Stream& stream) const {
  // Events are recorded in order on one copy stream: the last implies the rest.
  if (!events_.empty()) events_.back().block(stream);
}

void Transfer::wait_stream_for(int64_t index, const c10::Stream& stream) const {
  TORCH_CHECK_INDEX(index >= 0 && index < static_cast<int64_t>(outputs_.size()), "offload.CopyHandle.wait_tensor: ",
                    "index ", index, " out of range for ", outputs_.size(), " tensors");
  const int32_t event = event_of_[index];
  if (event >= 0) events_[event].block(stream);
}

class CopyEngine {
 public:
  // ------------------------------------------------------------ device -> host
  static std::shared_ptr<Transfer> to_host(const std::vector<at::Tensor>& tensors, HostPool& pool,
                                           const c10::optional<c10::Stream>& stream,
                                           const c10::optional<std::vector<at::Tensor>>& out,
                                           const std::shared_ptr<Transfer>& reuse, const CopyOptions& options) {
    const char* fn = "offload.copy_to_host";
    const c10::DeviceType expected = pool.device_type();
    const size_t n = tensors.size();
    for (size_t i = 0; i < n; ++i) check_source(fn, i, tensors[i], expected, tensors[0]);
    const std::vector<at::Tensor>* dests = out ? &*out : reuse ? &reuse->host_bases_ : nullptr;
    if (dests != nullptr) {
      TORCH_CHECK_VALUE(dests->size() == n, fn, ": out has ", dests->size(), " tensors but tensors has ", n);
    }
    const c10::Device device = n ? tensors[0].device() : c10::Device(expected);
    const bool on_device = !device.is_cpu();
    TORCH_CHECK_VALUE(!on_device || stream.has_value(), fn, ": a copy stream is required for ", device);

    auto result = std::make_shared<Transfer>(device);
    Transfer& r = *result;
    r.outputs_.resize(n);
    r.host_bases_.resize(n);
    r.restore_.resize(n);
    r.event_of_.assign(n, -1);

    // Sources that are neither dense nor broadcast become contiguous here, on the
    // caller's stream and before the start event, so the copy stream sees them.
    std::vector<at::Tensor> bases(n);
    std::vector<char> expanded(n, 0);
    for (size_t i = 0; i < n; ++i) {
      bool was_expanded = false;
      bases[i] = compact(tensors[i], &was_expanded);
      expanded[i] = was_expanded;
      if (!is_dense(bases[i]) && out == c10::nullopt) {
        bases[i] = bases[i].contiguous();
        r.restore_[i] = Transfer::Strides(tensors[i].sizes().vec(), tensors[i].strides().vec());
      }
      r.nbytes_ += tensor_nbytes(bases[i]);
    }
    if (out) {
      for (size_t i = 0; i < n; ++i) check_out(fn, i, tensors[i], (*out)[i], c10::Device(at::kCPU),
                                               options.require_pinned, pool.pinned());
    } else if (reuse) {
      for (size_t i = 0; i < n; ++i) {
        const at::Tensor& host = reuse->host_bases_[i];
        TORCH_CHECK_VALUE(same_layout(host, bases[i]), fn, ": out (a CopyHandle) was made for tensors[", i, "] with ",
                          describe(host), " and strides ", host.strides(), " but tensors[", i, "] now has ",
                          describe(bases[i]), " and strides ", bases[i].strides());
      }
    }

    c10::OptionalDeviceGuard device_guard;
    c10::optional<c10::StreamGuard> stream_guard;
    if (on_device) {
      device_guard.reset_device(device);
      c10::Event start(device.type());
      start.record(current_stream(device));
      start.block(*stream);
      stream_guard.emplace(*stream);
      r.keepalive_ = tensors;
      for (size_t i = 0; i < n; ++i) {
        if (!bases[i].is_same(tensors[i])) r.keepalive_.push_back(bases[i]);
      }
    }

    auto finish_group = [&](const std::vector<int64_t>& members) {
      if (!on_device) return;
      r.events_.emplace_back(device.type());
      r.events_.back().record(*stream);
      for (int64_t i : members) r.event_of_[i] = static_cast<int32_t>(r.events_.size() - 1);
    };

    if (out) {
      // Caller-owned destinations of any layout: one copy each, events every chunk_bytes.
      std::vector<int64_t> members;
      int64_t pending = 0;
      for (size_t i = 0; i < n; ++i) {
        const at::Tensor& dst = (*out)[i];
        if (is_dense(dst) && same_layout(dst, bases[i])) {
          copy_bytes(dst, bases[i], options.chunk_bytes, device);
        } else if (tensor_nbytes(bases[i]) > 0) {
          dst.copy_(tensors[i], /*non_blocking=*/true);
        }
        if (on_device) pool.record_stream(dst, *stream);
        r.outputs_[i] = r.host_bases_[i] = dst;
        members.push_back(static_cast<int64_t>(i));
        pending += tensor_nbytes(bases[i]);
        if (pending >= options.chunk_bytes || i + 1 == n) {
          finish_group(members);
          members.clear();
          pending = 0;
        }
      }
      if (on_device) InFlight::instance().add(result);
      return result;
    }

    if (reuse) {
      r.groups_ = reuse->groups_;
    } else {
      plan_host_groups(bases, options, r.groups_);
    }
    // Enqueue every copy first; the host-side views are made afterwards, while
    // the DMAs already run.
    for (auto& group : r.groups_) {
      if (!reuse) group.host_block = pool.allocate(static_cast<size_t>(group.bytes));
      if (group.packed) {
        run_packed_group(group, bases, device, on_device, r);
      } else {
        const int64_t i = group.members[0];
        at::Tensor host = reuse ? reuse->host_bases_[i]
                                : view_like(group.host_block.storage(), 0, bases[i], c10::Device(at::kCPU));
        copy_bytes(host, bases[i], options.chunk_bytes, device);
        r.host_bases_[i] = host;
      }
      if (on_device) pool.record_stream(group.host_block, *stream);
      finish_group(group.members);
    }
    if (on_device) InFlight::instance().add(result);
    if (reuse) {
      r.host_bases_ = reuse->host_bases_;
      r.outputs_ = reuse->outputs_;
      return result;
    }
    for (const auto& group : r.groups_) {
      if (!group.packed) continue;
      for (size_t k = 0; k < group.members.size(); ++k) {
        const int64_t i = group.members[k];
        r.host_bases_[i] = view_like(group.host_block.storage(), group.offsets[k], bases[i], c10::Device(at::kCPU));
      }
    }
    for (size_t i = 0; i < n; ++i) {
      if (!r.host_bases_[i].defined()) {  // empty tensors: nothing to move
        r.host_bases_[i] = at::empty_strided(bases[i].sizes(), bases[i].strides(),
                                             bases[i].options().device(at::kCPU));
      }
      r.outputs_[i] = expanded[i] ? r.host_bases_[i].expand(tensors[i].sizes()) : r.host_bases_[i];
    }
    return result;
  }

  // ------------------------------------------------------------ host -> device
  static std::shared_ptr<Transfer> to_device(const std::vector<at::Tensor>& tensors,
                                             const std::shared_ptr<Transfer>& from, const c10::Device& device,
                                             HostPool& pool, const c10::optional<c10::Stream>& stream,
                                             const c10::optional<std::vector<at::Tensor>>& out,
                                             const CopyOptions& options) {
    const char* fn = "offload.copy_to_device";
    const size_t n = tensors.size();
    const bool on_device = !device.is_cpu();
    // Asking the driver whether memory is pinned costs ~1 us, so ask once per storage.
    std::unordered_map<const void*, bool> pinned_storages;
    auto is_pinned = [&](const at::Tensor& t) {
      const void* key = t.storage().data();
      auto it = pinned_storages.find(key);
      if (it == pinned_storages.end()) it = pinned_storages.emplace(key, pool.owns(t) || t.is_pinned()).first;
      return it->second;
    };
    for (size_t i = 0; i < n; ++i) {
      check_source(fn, i, tensors[i], c10::DeviceType::CPU, tensors[0]);
      if (on_device && options.require_pinned && !from && tensors[i].numel() > 0) {
        TORCH_CHECK_VALUE(is_pinned(tensors[i]), fn, ": tensors[", i, "] is not pinned, so the copy would block "
                          "the host; pass pinned memory (offload.copy_to_host results, offload.HostPool.empty, "
                          "tensor.pin_memory()) or require_pinned=False");
      }
    }
    if (out) {
      TORCH_CHECK_VALUE(out->size() == n, fn, ": out has ", out->size(), " tensors but tensors has ", n);
      for (size_t i = 0; i < n; ++i) check_out(fn, i, tensors[i], (*out)[i], device, options.require_pinned, false);
    }
    TORCH_CHECK_VALUE(!on_device || stream.has_value(), fn, ": a copy stream is required for ", device);

    auto result = std::make_shared<Transfer>(device);
    Transfer& r = *result;
    r.outputs_.resize(n);
    r.restore_.resize(n);
    r.event_of_.assign(n, -1);
    if (from && !on_device) from->synchronize();

    std::vector<at::Tensor> bases(n);
    std::vector<char> expanded(n, 0);
    for (size_t i = 0; i < n; ++i) {
      bool was_expanded = false;
      bases[i] = compact(tensors[i], &was_expanded);
      expanded[i] = was_expanded;
      if (!is_dense(bases[i])) {
        if (from) from->synchronize();  // a host-side copy must see the finished transfer
        bases[i] = bases[i].contiguous();
      }
      r.nbytes_ += tensor_nbytes(bases[i]);
    }

    c10::OptionalDeviceGuard device_guard;
    if (on_device) device_guard.reset_device(device);
    const auto device_options = at::TensorOptions().dtype(at::kByte).device(device);

    // Plan: small tensors grouped into spans of one host storage; the rest alone.
    std::vector<Span> spans = plan_spans(bases, options, out.has_value());

    // Outputs are allocated now, on the consumer's stream (see transfer.h): one
    // device buffer per span, viewed per tensor.
    std::vector<at::Tensor> targets(n), finals(n);
    for (auto& span : spans) {
      if (out) break;
      span.device_buffer = at::empty({span.bytes}, device_options);
      for (size_t k = 0; k < span.members.size(); ++k) {
        const int64_t i = span.members[k];
        targets[i] = view_like(span.device_buffer.storage(), span.offsets[k], bases[i], device);
      }
    }
    for (size_t i = 0; i < n; ++i) {
      if (out) {
        targets[i] = (*out)[i];
      } else if (!targets[i].defined()) {  // empty tensors sit in no span
        targets[i] = at::empty_strided(bases[i].sizes(), bases[i].strides(), bases[i].options().device(device));
      }
      if (from && !out && from->restore_.size() == n && from->restore_[i]) {
        const auto& spec = *from->restore_[i];
        finals[i] = at::empty_strided(spec.first, spec.second, bases[i].options().device(device));
      }
    }

    c10::optional<c10::StreamGuard> stream_guard;
    if (on_device) {
      c10::Event start(device.type());
      start.record(current_stream(device));
      start.block(*stream);
      if (from) from->wait_stream(*stream);
      stream_guard.emplace(*stream);
      r.keepalive_ = bases;  // host sources: their blocks stay ours until the copies end
    }

    auto finish_group = [&](const std::vector<int64_t>& members) {
      if (!on_device) return;
      r.events_.emplace_back(device.type());
      r.events_.back().record(*stream);
      for (int64_t i : members) r.event_of_[i] = static_cast<int32_t>(r.events_.size() - 1);
    };
    std::unordered_set<const void*> recorded_storages;
    auto protect_source = [&](const at::Tensor& host) {
      if (on_device && recorded_storages.insert(host.storage().data()).second) pool.record_stream(host, *stream);
    };

    for (auto& span : spans) {
      const at::Tensor& first = bases[span.members[0]];
      const char* host_ptr = static_cast<const char*>(first.storage().data()) + span.storage_offset;
      if (!out) {
        for (int64_t at = 0; at < span.bytes; at += options.chunk_bytes) {
          copy_bytes_async(static_cast<char*>(span.device_buffer.data_ptr()) + at, false, host_ptr + at, true,
                           std::min(options.chunk_bytes, span.bytes - at), device);
        }
      } else if (span.members.size() == 1 && same_layout(targets[span.members[0]], first) &&
                 is_dense(targets[span.members[0]])) {
        copy_bytes(targets[span.members[0]], first, options.chunk_bytes, device);
      } else if (span.bytes > 0) {
        // Into caller-owned tensors: DMA the span into staging (allocated while the
        // copy stream is current, so it owns it), then one multi-tensor copy scatters it.
        at::Tensor staging = at::empty({span.bytes}, device_options);
        copy_bytes_async(staging.data_ptr(), false, host_ptr, true, span.bytes, device);
        std::vector<ByteRange> ranges;
        for (size_t k = 0; k < span.members.size(); ++k) {
          const int64_t i = span.members[k];
          at::Tensor view = view_like(staging.storage(), span.offsets[k], bases[i], device);
          if (same_layout(targets[i], view) && is_dense(view)) {
            ranges.push_back({view.data_ptr(), targets[i].data_ptr(), tensor_nbytes(view)});
          } else {
            targets[i].copy_(expanded[i] ? view.expand(tensors[i].sizes()) : view, /*non_blocking=*/true);
          }
        }
        multi_tensor_copy(ranges, device);
        if (on_device) r.keepalive_.push_back(staging);
      }
      if (span.bytes > 0) protect_source(first);
      for (int64_t i : span.members) {
        if (finals[i].defined()) finals[i].copy_(targets[i], /*non_blocking=*/true);
      }
      finish_group(span.members);
    }
    if (on_device) InFlight::instance().add(result);

    for (size_t i = 0; i < n; ++i) {
      at::Tensor result_i = finals[i].defined() ? finals[i] : targets[i];
      if (expanded[i] && !out) result_i = result_i.expand(tensors[i].sizes());
      r.outputs_[i] = result_i;
    }
    return result;
  }

 private:
  struct Span {
    std::vector<int64_t> members;
    std::vector<int64_t> offsets;  // byte offset of each member from the span's start
    int64_t storage_offset = 0;    // byte offset of the span in its host storage
    int64_t bytes = 0;
    at::Tensor device_buffer;
  };

  static void plan_host_groups(const std::vector<at::Tensor>& bases, const CopyOptions& options,
                               std::vector<Transfer::Group>& groups) {
    const int64_t limit = group_limit(options);
    Transfer::Group packed;
    packed.packed = true;
    auto close_packed = [&]() {
      if (packed.members.empty()) return;
      groups.push_back(std::move(packed));
      packed = Transfer::Group();
      packed.packed = true;
    };
    for (size_t i = 0; i < bases.size(); ++i) {
      const int64_t nbytes = tensor_nbytes(bases[i]);
      if (nbytes == 0) continue;
      if (nbytes >= options.small_bytes) {
        Transfer::Group direct;
        direct.bytes = nbytes;
        direct.members.push_back(static_cast<int64_t>(i));
        groups.push_back(std::move(direct));
        continue;
      }
      int64_t offset = align_up(packed.bytes);
      if (!packed.members.empty() && offset + nbytes > limit) {
        close_packed();
        offset = 0;
      }
      packed.members.push_back(static_cast<int64_t>(i));
      packed.offsets.push_back(offset);
      packed.bytes = offset + nbytes;
    }
    close_packed();
  }

  static void run_packed_group(Transfer::Group& group, const std::vector<at::Tensor>& bases,
                               const c10::Device& device, bool on_device, Transfer& r) {
    std::vector<ByteRange> ranges;
    ranges.reserve(group.members.size());
    char* target = static_cast<char*>(group.host_block.data_ptr());
    if (on_device) {
      // Allocated while the copy stream is current: it owns the staging buffer.
      at::Tensor staging = at::empty({group.bytes}, at::TensorOptions().dtype(at::kByte).device(device));
      target = static_cast<char*>(staging.data_ptr());
      r.keepalive_.push_back(staging);
    }
    for (size_t k = 0; k < group.members.size(); ++k) {
      const at::Tensor& base = bases[group.members[k]];
      ranges.push_back({base.data_ptr(), target + group.offsets[k], tensor_nbytes(base)});
    }
    multi_tensor_copy(ranges, device);
    if (on_device) {
      copy_bytes_async(group.host_block.data_ptr(), true, target, false, group.bytes, device);
    }
  }

  static std::vector<Span> plan_spans(const std::vector<at::Tensor>& bases, const CopyOptions& options, bool to_out) {
    const int64_t limit = group_limit(options);
    std::vector<Span> spans;
    // Small tensors of one storage, by address: neighbours within kMaxSpanGap
    // share a DMA (reading a small host gap is cheaper than another transfer).
    std::map<std::pair<const void*, int64_t>, int64_t> small;  // (storage, byte offset) -> index
    for (size_t i = 0; i < bases.size(); ++i) {
      const at::Tensor& b = bases[i];
      const int64_t nbytes = tensor_nbytes(b);
      if (nbytes > 0 && nbytes < options.small_bytes) {
        const int64_t offset = b.storage_offset() * static_cast<int64_t>(b.element_size());
        small.emplace(std::make_pair(b.storage().data(), offset), static_cast<int64_t>(i));
        continue;
      }
      Span span;
      span.members.push_back(static_cast<int64_t>(i));
      span.offsets.push_back(0);
      span.storage_offset = b.storage_offset() * static_cast<int64_t>(b.element_size());
      span.bytes = nbytes;
      spans.push_back(std::move(span));
    }
    Span current;
    const void* current_storage = nullptr;
    for (const auto& entry : small) {
      const int64_t i = entry.second;
      const int64_t offset = entry.first.second;
      const int64_t nbytes = tensor_nbytes(bases[i]);
      const int64_t itemsize = static_cast<int64_t>(bases[i].element_size());
      const int64_t end = current.storage_offset + current.bytes;
      const bool joins = !current.members.empty() && entry.first.first == current_storage && offset >= end - 0 &&
                         offset - end <= kMaxSpanGap && offset + nbytes - current.storage_offset <= limit &&
                         (offset - current.storage_offset) % std::max<int64_t>(itemsize, kAlign) == 0;
      if (!joins) {
        if (!current.members.empty()) spans.push_back(std::move(current));
        current = Span();
        current.storage_offset = offset;
        current_storage = entry.first.first;
      }
      current.members.push_back(i);
      current.offsets.push_back(offset - current.storage_offset);
      current.bytes = std::max(current.bytes, offset + nbytes - current.storage_offset);
    }
    if (!current.members.empty()) spans.push_back(std::move(current));
    (void)to_out;
    return spans;
  }
};

std::shared_ptr<Transfer> copy_to_host(const std::vector<at::Tensor>& tensors, HostPool& pool,
                                       const c10::optional<c10::Stream>& stream,
                                       const c10::optional<std::vector<at::Tensor>>& out,
                                       const std::shared_ptr<Transfer>& out_transfer, const CopyOptions& options) {
  return CopyEngine::to_host(tensors, pool, stream, out, out_transfer, options);
}

std::shared_ptr<Transfer> copy_to_device(const std::vector<at::Tensor>& tensors,
                                         const std::shared_ptr<Transfer>& from, const c10::Device& device,
                                         HostPool& pool, const c10::optional<c10::Stream>& stream,
                                         const c10::optional<std::vector<at::Tensor>>& out,
                                         const CopyOptions& options) {
  return CopyEngine::to_device(tensors, from, device, pool, stream, out, options);
}

namespace {

void bind_copy_engine(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<Transfer, std::shared_ptr<Transfer>>(m, "Transfer")
      .def("tensors", &Transfer::tensors)
      .def("nbytes", &Transfer::nbytes)
      .def("device", &Transfer::device)
      .def("restore_specs", &Transfer::restore_specs)
      .def("query", &Transfer::query)
      .def("synchronize", &Transfer::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("wait_stream", [](const Transfer& t, c10::optional<c10::Stream> s) { if (s) t.wait_stream(*s); })
      .def("wait_stream_for",
           [](const Transfer& t, int64_t i, c10::optional<c10::Stream> s) { if (s) t.wait_stream_for(i, *s); });
  auto make_options = [](bool require_pinned, int64_t small_bytes, int64_t chunk_bytes) {
    CopyOptions o;
    o.require_pinned = require_pinned;
    o.small_bytes = small_bytes;
    o.chunk_bytes = chunk_bytes;
    return o;
  };
  m.def("copy_to_host",
        [make_options](const std::vector<at::Tensor>& tensors, HostPool& pool, c10::optional<c10::Stream> stream,
                       c10::optional<std::vector<at::Tensor>> out, std::shared_ptr<Transfer> reuse,
                       bool require_pinned, int64_t small_bytes, int64_t chunk_bytes) {
          py::gil_scoped_release no_gil;
          return copy_to_host(tensors, pool, stream, out, reuse, make_options(require_pinned, small_bytes, chunk_bytes));
        });
  m.def("copy_to_device",
        [make_options](const std::vector<at::Tensor>& tensors, std::shared_ptr<Transfer> from, c10::Device device,
                       HostPool& pool, c10::optional<c10::Stream> stream, c10::optional<std::vector<at::Tensor>> out,
                       bool require_pinned, int64_t small_bytes, int64_t chunk_bytes) {
          py::gil_scoped_release no_gil;
          return copy_to_device(tensors, from, device, pool, stream, out,
                                make_options(require_pinned, small_bytes, chunk_bytes));
        });
}

}  // namespace

OFFLOAD_REGISTER_BINDINGS(b_copy_engine, bind_copy_engine);

}  // namespace offload
