// The activation engine's data plane in native code: one group of saved tensors
// (ActivationGroup), what autograd holds for an offloaded tensor (SavedActivation),
// and the per-forward table the pack hook consults (PackTable).
//
// Why: in a step whose pace the host sets (short layers, small batches) every
// microsecond the engine spends per saved tensor is step time. The per-tensor work
// (the pack decision, span and view bookkeeping, the unpack's version check and
// view) and the per-group data work (sealing the spans, issuing the copy out,
// dropping the held tensors, restoring views) run here; the engine in Python
// (offload/activation/engine.py, forward.py, backward.py) keeps the policy, at one call per
// group: when a group opens and closes, which groups are fetched and released and
// when, the events, the timings and auto mode. In the engine's plain configuration a
// group's whole cycle runs in native code too (group_cycle.h), the engine's per-layer
// fields being this class's members. The pure-PyTorch path runs the same
// engine over groups.py's `Group` and pack_table.py's `PackTable`, the Python twins
// of these classes, with the same attributes and methods (a test holds the two
// paths equal, gradients and statistics).
//
// Streams: the spans are read by the device-to-host copy stream the engine names
// (the copy engine holds them until the copy is done, Note [in-flight registry]);
// the restored block is allocated by the engine on the consumer's stream, which
// owns it, and waits for its copy back before the first view is read (the engine's
// `_make_ready`, recorded here per stream by `mark_ready`).
//
// Everything here runs with the interpreter lock held, on the thread autograd calls
// the hooks from, but the copy call, which lets it go.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <c10/core/Stream.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/extension.h>

#include "offload/host_pool.h"
#include "offload/transfer.h"

namespace offload {
namespace activation {

namespace py = pybind11;

// groups.py's OPEN, COPYING, HOST, KEPT.
enum GroupState : int { kOpen = 0, kCopying = 1, kHost = 2, kKept = 3 };

// groups.py's SPAN_ALIGN: a copied span starts on the caching allocator's block
// alignment, so a restored view has the original's address modulo 512.
constexpr int64_t kSpanAlign = 512;

// `bytes` rounded up to a multiple of kSpanAlign.
constexpr int64_t span_aligned(int64_t bytes) { return (bytes + kSpanAlign - 1) / kSpanAlign * kSpanAlign; }

// Bytes [lo, hi) of one storage that the group copies, read through `tensor`.
struct SavedSpan {
  at::Tensor tensor;
  int64_t lo;
  int64_t hi;
  int64_t version = -1;  // the tensor's version when the group closed (a later save shares the copy only at it)
};

// A saved tensor's Python object and its version at save, while the device data is valid.
struct HeldTensor {
  py::object tensor;
  int64_t version;
};

// A tensor's sizes or strides: inline up to 6 dimensions (no allocation per saved tensor).
using Dims = c10::SmallVector<int64_t, 6>;

// A restored view, made once per (span, dtype, size, stride, offset) and group.
struct RestoredView {
  int64_t entry;
  at::ScalarType dtype;
  Dims size;
  Dims stride;
  int64_t offset;
  py::object tensor;
};

class ActivationGroup;

// What autograd holds instead of an offloaded tensor: its group (held alive by this),
// the span it reads, its handle slot, and how to rebuild it from the restored block.
struct SavedActivation {
  py::object group;  // the Python object of `native`
  ActivationGroup* native;
  int64_t entry;
  int64_t slot;
  at::ScalarType dtype;
  Dims size;
  Dims stride;
  int64_t offset;  // bytes from the start of the storage
};

// SavedActivation's Python object, offload._C.SavedActivation: a plain CPython type, not a
// pybind11 class (a pybind11 instance is registered in and removed from its instance map,
// host time per saved tensor). Made only here; `group` and `slot` read it.
py::object make_saved_activation(SavedActivation&& value);
// The SavedActivation of `obj`, or null where it is not one.
const SavedActivation* saved_activation_of(PyObject* obj);
// Adds the type to module `m`.
void add_saved_activation_type(py::module_& m);

class ActivationGroup {
 public:
  ActivationGroup(py::object name, py::object layer, bool offload, py::object prev);

  // The engine's per-layer fields (groups.py's `LayerFields` gives each one's meaning).
  py::object name;
  int64_t serial;  // unique in the process, from one counter for both paths (next_group_serial)
  py::object layer;  // int, or None
  py::object prev;  // weakref to the previous offloaded group of the same forward, or None
  py::object split;  // its layer's part ends (a list), or None
  int64_t part = 0;
  bool continued = false;
  int64_t n_layers = 1;
  py::object auto_state;  // "auto": auto mode's AutoState, or None
  py::object checksums;  // verify=True: verify.py's GroupChecksums, or None

  int state;
  int64_t n_handles = 0;  // handles packed into it
  int64_t n_unpacked = 0;  // handles unpacked in the current backward
  int64_t capped = 0;  // bytes of its layer's new spans so far (against a cap and part ends)
  int64_t new_spans = 0;  // new storage spans of its layer so far
  int64_t nbytes = 0;  // bytes of its spans (set by seal)
  int64_t nbytes_aligned = 0;  // bytes of its host block (set by copy_out)
  int64_t fetched = 0;  // bytes of the block copied back so far (or queued to be)
  bool holds_device_tensors = true;  // `held` is valid: the device data is still what was saved
  bool has_spans = true;

  std::vector<SavedSpan> spans;
  std::vector<HeldTensor> held;
  at::Tensor device_block;  // the restored uint8 block, laid out as the host block
  // The stream `device_block` was allocated on, its owner (none on the host, or before a fetch).
  c10::optional<c10::Stream> fetch_stream;
  // The stream its tensors were saved on (current when it closed; none on the host).
  c10::optional<c10::Stream> stream;
  // Its copy out (set at close; its one tensor is the pooled host block), and its copies back
  // in the current backward (one, or one per piece, queued in order on one copy stream). Held
  // here, not as Python objects: a step's groups make no Python object for their copies but
  // where Python code reads them (the `d2h` property, `h2d_handles`).
  std::shared_ptr<Transfer> d2h;
  std::vector<std::shared_ptr<Transfer>> h2d;

  // Pack: the handle slot of `tensor` (saved at `version`) in this group.
  int64_t hold(const py::object& tensor, int64_t version);
  // Close: each span's start and version; its bytes into `nbytes`. The span count.
  int64_t seal();
  // Close: one copy of the spans into a pooled host block laid out at aligned offsets.
  std::shared_ptr<Transfer> copy_out(HostPool& pool, const c10::optional<c10::Stream>& stream, int64_t chunk_bytes,
                                     bool timing);
  void drop_spans();
  // The copy is complete (or ordered before every reader): let go of the held tensors,
  // keeping what the version check needs (Note [version counter] in saved_tensors.py).
  void drop_held();
  // The spans' memory is protected by `stream` (the copy stream) until it passes the copy.
  void let_sources_go(const c10::Stream& stream);
  // Backward let go of the group: its restored block, views and waits go.
  void reset_restore();
  // Its copy out is complete and not all of it was brought back yet (groups.py's `on_host_only`).
  bool on_host_only() const { return state == kHost && fetched < nbytes_aligned && d2h != nullptr; }
  // Whether the restored block was allocated on `stream` (its owner).
  bool owns_block(const c10::optional<c10::Stream>& stream) const {
    return fetch_stream.has_value() && fetch_stream == stream;
  }
  // Whether its tensors were saved on `stream` (none: on the host, never).
  bool saved_on(const c10::optional<c10::Stream>& s) const { return s.has_value() && stream == s; }
  // Whether the consumer on `stream` (none: the host, no streams) already waits for the copy back.
  bool ready_on(const c10::optional<c10::Stream>& stream) const;
  // Records that it does; true if it is the group's first reader in this backward.
  bool mark_ready(const c10::optional<c10::Stream>& stream);
  // verify=True (offload/activation/verify.py), while the spans are held: each span's bytes
  // as a uint8 tensor of its storage, and "dtype [sizes]" of the tensor it was saved through.
  std::vector<at::Tensor> span_bytes() const;
  std::vector<std::string> span_descriptions() const;
  // After copy_out: each span's bytes in `block` (the host block or the restored one).
  std::vector<at::Tensor> block_spans(const at::Tensor& block) const;
  // The held tensor of `packed`, while the group holds them; raises autograd's error for
  // a tensor modified in place after it was saved.
  py::object unpack_held(const SavedActivation& packed) const;
  // Once the held tensors are gone: the same error, from what drop_held recorded.
  void check_not_modified(const SavedActivation& packed) const;
  // `packed`'s view of the restored block (the engine made the group ready first).
  py::object restored_view(const SavedActivation& packed);

 private:

  std::vector<int64_t> offsets_;  // per span: where it starts in the block (bytes)
  std::vector<int64_t> span_starts_;  // per span: where it starts in its storage (bytes)
  std::vector<int64_t> sizes_;  // per span: its bytes (set by copy_out)
  // After drop_held, per slot: the saved tensor's version counter (shared, not a copy) and
  // its version at save; -1 where nothing else could change it.
  std::vector<std::pair<c10::VariableVersion, int64_t>> watch_;
  // Slots modified in place before the copy was confirmed: (description, saved, now).
  std::unordered_map<int64_t, std::tuple<std::string, int64_t, int64_t>> modified_;
  std::vector<std::pair<at::ScalarType, at::Tensor>> typed_blocks_;
  std::vector<RestoredView> views_;
  std::vector<c10::Stream> ready_streams_;
  bool ready_on_host_ = false;
};

// The next group serial of the process (ActivationEvent.serial), for both paths' groups.
int64_t next_group_serial();

// Python's view of a transfer: offload.core.copy.CopyHandle around it (the class is given
// once, `set_copy_handle_class`), or None for a null transfer.
void set_copy_handle_class(py::object handle_class);
py::object copy_handle(const std::shared_ptr<Transfer>& transfer);
// The transfer a CopyHandle (or None: null) wraps.
std::shared_ptr<Transfer> transfer_of(const py::object& handle);

// The error autograd raises for a saved tensor modified in place (saved_tensors.py's
// `modified_error`, whose message this repeats): `desc` is "dtype [sizes]".
[[noreturn]] void raise_modified(const std::string& desc, int64_t saved, int64_t now);
// saved_tensors.py's `describe`: "float32 [4, 16]".
std::string describe(at::ScalarType dtype, at::IntArrayRef size);

}  // namespace activation
}  // namespace offload
