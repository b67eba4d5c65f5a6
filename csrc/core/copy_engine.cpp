// The copy engine's shared helpers (copy_engine.h) and the public entry points of
// include/offload/transfer.h, each a call into one part of the engine.
//
// Every copy issued here is a byte copy between dense layouts of identical
// strides (copy_bytes, copy_chunked) on the current stream; the parts decide
// which bytes move where and on which stream.
#include "copy_engine.h"

#include <map>
#include <mutex>
#include <utility>

#include <c10/core/impl/VirtualGuardImpl.h>

#include "offload/checks.h"
#include "offload/event_cache.h"
#include "offload/multi_tensor_copy.h"
#include "offload/tensor_layout.h"

namespace offload {
namespace {

std::string type_name(c10::DeviceType type) { return c10::DeviceTypeName(type, /*lower_case=*/true); }

}  // namespace

c10::Stream CopyEngine::current_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

// Note [pack stream]
// A side stream per device for packing, so that packing group k+1 on the SMs
// overlaps the DMA of group k on the copy engine; on one stream they would take
// turns. Never destroyed: the copy worker may still ask for a stream while
// statics are torn down at exit.
c10::Stream CopyEngine::pack_stream(const c10::Device& device) {
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

void CopyEngine::check_source(const char* fn, size_t i, const at::Tensor& t, c10::DeviceType expected,
                              const at::Tensor& first) {
  // The common case in one pass (runs per tensor per call); the checks below
  // name what is wrong.
  if (C10_LIKELY(t.defined() && t.layout() == at::kStrided && t.device() == first.device() &&
                 t.device().type() == expected && !t.is_meta() && has_data(t))) {
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
  check_has_data(t, fn, "tensors[", i, "]");
}

void CopyEngine::check_out(const char* fn, size_t i, const at::Tensor& src, const at::Tensor& dst,
                           const c10::Device& where, bool require_pinned, bool pinning) {
  TORCH_CHECK_VALUE(dst.defined(), fn, ": out[", i, "] is an undefined tensor");
  TORCH_CHECK_VALUE(dst.sizes() == src.sizes() && dst.scalar_type() == src.scalar_type(), fn, ": out[", i,
                    "] has ", describe(dst), " but tensors[", i, "] has ", describe(src));
  TORCH_CHECK_VALUE(dst.device().type() == where.type(), fn, ": out[", i, "] is on ", dst.device(), " but a ",
                    type_name(where.type()), " tensor is expected");
  check_has_data(dst, fn, "out[", i, "]");  // a parked parameter as a destination: nowhere to write
  if (where.type() != c10::DeviceType::CPU) {
    TORCH_CHECK_VALUE(dst.device() == where, fn, ": out[", i, "] is on ", dst.device(), " but the destination is ",
                      where);
  } else if (require_pinned && pinning && dst.numel() > 0) {  // nothing to move, nothing to pin
    TORCH_CHECK_VALUE(dst.is_pinned(), fn, ": out[", i, "] is not pinned, so the copy would block the host; pass "
                      "pinned memory (offload.HostPool.empty, tensor.pin_memory()) or require_pinned=False");
  }
}

void CopyEngine::copy_chunked(char* dst, bool dst_on_host, const char* src, bool src_on_host, int64_t nbytes,
                              int64_t chunk_bytes, const c10::Device& device) {
  for (int64_t at = 0; at < nbytes; at += chunk_bytes) {
    copy_bytes_async(dst + at, dst_on_host, src + at, src_on_host, std::min(chunk_bytes, nbytes - at), device);
  }
}

void CopyEngine::copy_bytes(const at::Tensor& dst, const at::Tensor& src, int64_t chunk_bytes,
                            const c10::Device& device) {
  copy_chunked(static_cast<char*>(dst.data_ptr()), dst.is_cpu(), static_cast<const char*>(src.data_ptr()),
               src.is_cpu(), tensor_nbytes(src), chunk_bytes, device);
}

void CopyEngine::record_timing(SharedEvent& event, const c10::Stream& stream) {
  event = record_event(stream, c10::EventFlag::BACKEND_DEFAULT);
}

void CopyEngine::hold_sources(Transfer& r, const std::vector<at::Tensor>& sources,
                              const c10::optional<c10::Stream>& stream, const SharedEvent& at) {
  r.keepalive_.insert(r.keepalive_.end(), sources.begin(), sources.end());
  r.release_keepalive(stream, /*drain=*/true, at);
}

void CopyEngine::hold_sources(Transfer& r, TensorSource& tensors, bool on_device,
                              const c10::optional<c10::Stream>& stream) {
  hold_sources(r, on_device ? tensors.converted() : std::vector<at::Tensor>(), stream);
}

void CopyEngine::check_same_sources(const CopyOptions& options, const std::shared_ptr<Transfer>& reuse) {
  TORCH_CHECK_VALUE(!options.same_sources || (reuse && reuse->source_keys_), "offload.copy_to_host: "
                    "same_sources=True needs out=<CopyHandle> from a copy_to_host without out (whose buffers "
                    "the engine made), got ", reuse ? "a handle made with an out list" : "none");
}

void CopyEngine::check_reuse_count(const Transfer& reuse, size_t n) {
  TORCH_CHECK_VALUE(reuse.host_bases_->size() == n, "offload.copy_to_host: out has ", reuse.host_bases_->size(),
                    " tensors but tensors has ", n);
}

bool CopyEngine::needs_new_tensor(const at::Tensor& t) {
  if (t.is_conj() || t.is_neg()) return true;
  if (t.is_contiguous()) return false;
  bool expanded = false;
  return !is_dense(compact(t, &expanded));
}

CopyEngine::Prepared CopyEngine::prepare(const at::Tensor& t, bool allow_contiguous) {
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

}  // namespace offload
