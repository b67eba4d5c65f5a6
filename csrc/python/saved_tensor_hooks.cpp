// The activation engine's saved-tensor hooks and the table they pack into, in C.
//
// Why: in a step whose pace the host sets every microsecond the hooks spend on a saved
// tensor is step time. Here a saved tensor costs no interpreter call: the pack decision
// (offload_extent: about fifteen attribute reads in Python), the parameter check, the
// span bookkeeping and the handle autograd holds; at unpack the version check, the view
// of the restored block and the counts that tell the engine when a group was reached
// and when it can go. The engine in Python is called once per group (activation_group.h
// says what runs where).
//
// - offload_extent is offload/activation/saved_tensors.py's `offload_extent` in C (the
//   Python path without the core uses that one; a test holds the two equal on a catalogue
//   of tensors).
// - pack_saved_tensor(table, t) is the pack hook (bound to the engine's PackTable with
//   functools.partial). With no group open it hands the tensor to the engine's Python
//   `pack`, which counts what is saved after the last layer; a tensor that stays it keeps
//   here, as the engine does (counted); one that may be offloaded joins the open group.
// - unpack_saved_tensor(table, packed) returns a kept tensor whose version is unchanged,
//   serves an offloaded one from its group, and hands the rest (the step's first unpack of
//   a kept tensor, a modified tensor's error) to the engine's `unpack`.
// The table's PackTable is the twin of offload/activation/pack_table.py's, and its
// methods those of engine.py's pack path without the core.
#include <cstdint>
#include <exception>
#include <string>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <torch/csrc/Device.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include "activation_group.h"
#include "engine_interface.h"
#include "group_cycle.h"
#include "offload/bindings_registry.h"

namespace offload {
namespace {

namespace py = pybind11;
using activation::ActivationGroup;
using activation::GroupCycle;
using activation::attr;
using activation::call;
using activation::truthy;
using activation::SavedActivation;
using activation::SavedSpan;
using activation::kCopying;
using activation::kKept;
using activation::kSpanAlign;

// Whether the last component of `node`'s C++ type name is `name` (Node::name() demangles,
// an allocation per call: the answer is cached per type, keyed by the address of its
// type_info, which a hash of std::type_index would hash the type's name to find). The Python
// path compares the node's Python class name, which is that same last component.
bool node_is(const torch::autograd::Node& node, const char* name) {
  static std::unordered_map<const std::type_info*, std::string> names;
  const std::type_info* type = &typeid(node);
  auto it = names.find(type);
  if (it == names.end()) {
    std::string full = node.name();
    const auto colon = full.rfind("::");
    it = names.emplace(type, colon == std::string::npos ? full : full.substr(colon + 2)).first;
  }
  return it->second == name;
}

// Whether `t` (a leaf that needs no grad) is a frozen parameter: of nn.Parameter's type or a
// subclass's, read from its Python object (made for it here if it has none; then it is none).
bool is_parameter(const at::Tensor& t) {
  static PyObject* parameter_type = py::object(py::module_::import("torch.nn").attr("Parameter")).release().ptr();
  PyObject* object = THPVariable_Wrap(t);
  if (object == nullptr) throw py::error_already_set();
  const bool is = PyObject_TypeCheck(object, reinterpret_cast<PyTypeObject*>(parameter_type));
  Py_DECREF(object);
  return is;
}

struct Extent {
  int64_t ptr;  // the storage's data pointer
  int64_t first;  // first byte of the storage the tensor reads
  int64_t last;  // one past the last byte it reads
  bool check_params;  // its base has no grad_fn: it may share a parameter's or input's storage
};

// Whether the engine may offload `t`, a plain tensor saved while a group is open; the
// reasons it stays are listed at offload/activation/saved_tensors.py's `offload_extent`.
bool offload_extent_of(const at::Tensor& t, int64_t min_bytes, const c10::Device& device, Extent* out) {
  const int64_t numel = t.numel();
  const int64_t itemsize = t.element_size();
  if (numel * itemsize < min_bytes || numel == 0) return false;
  if (t.device() != device || t.layout() != at::kStrided) return false;
  if (torch::autograd::get_current_graph_task_id() != -1) return false;  // saved in backward: a recompute
  at::Tensor base = t;
  if (t.is_view()) base = t._base();
  if (base.requires_grad() && base.is_leaf()) return false;  // a leaf that requires grad, or its view
  // A shared_ptr up to torch 2.12, an intrusive_ptr from 2.13: both have get() and ->.
  const auto& grad_fn = base.grad_fn();
  // A frozen parameter's view (a weight's transpose): stays as a trainable one's does, known by
  // its base's type, without a walk of the model's storages (Note [parameter walk]).
  if (grad_fn.get() == nullptr && t.is_view() && is_parameter(base)) return false;
  if (grad_fn.get() != nullptr && grad_fn->num_outputs() > 0 && node_is(*grad_fn, "ToCopyBackward0")) {
    const auto& source = grad_fn->next_edge(0).function;
    if (source.get() != nullptr && node_is(*source, "AccumulateGrad")) return false;  // autocast's cast of a leaf
  }
  if (t.is_complex() && (t.is_conj() || t.is_neg())) return false;
  int64_t first = t.storage_offset() * itemsize;
  int64_t last = first + itemsize;
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (size_t d = 0; d < sizes.size(); ++d) last += (sizes[d] - 1) * strides[d] * itemsize;
  out->ptr = reinterpret_cast<int64_t>(t.storage().data());
  out->first = first;
  out->last = last;
  out->check_params = grad_fn.get() == nullptr;
  return true;
}

// (storage data_ptr, first byte, end byte, check_params), or None where `t` stays.
py::object offload_extent(const at::Tensor& t, int64_t min_bytes, const c10::Device& device) {
  Extent extent{};
  if (!offload_extent_of(t, min_bytes, device, &extent)) return py::none();
  return py::make_tuple(extent.ptr, extent.first, extent.last, extent.check_params);
}

// What autograd holds for a tensor that stays: (tensor, version at save), as the engine
// keeps one, which is also counted. The version is read as Python reads it (a subclass may
// answer it itself), so the engine's `unpack` compares like with like.
py::object keep(py::handle engine, py::handle tensor) {
  const activation::EngineNames& n = activation::engine_names();
  py::object counters = attr(engine, n.counters);
  PyObject* kept = PyDict_GetItemWithError(counters.ptr(), n.tensors_kept);  // borrowed
  if (kept == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "tensors_kept");
    throw py::error_already_set();
  }
  py::object more = py::reinterpret_steal<py::object>(PyNumber_Add(kept, py::int_(1).ptr()));
  if (!more || PyDict_SetItem(counters.ptr(), n.tensors_kept, more.ptr()) < 0) throw py::error_already_set();
  return py::make_tuple(py::reinterpret_borrow<py::object>(tensor), attr(tensor, n.version));
}

// The data pointer of `t`'s storage, 0 for a tensor without one (meta, fake, a wrapper subclass).
int64_t storage_ptr(const at::Tensor& t) {
  if (!t.has_storage()) return 0;
  return reinterpret_cast<int64_t>(t.storage().data());
}

// Calls a Python callable when backward computes the gradient of a tensor: a pre-hook of the
// tensor's node in C++ (engine.py's backward start, and auto mode's fetch points). A Python hook
// makes a handle object and a dict of hooks per registration, host time in every step. Node
// pre-hooks run after the node's tensor hooks (Note [after FSDP2's hook]).
class CallOnGradient : public torch::autograd::FunctionPreHook {
 public:
  explicit CallOnGradient(py::object call) : call_(call.release().ptr()) {}
  ~CallOnGradient() override {
    if (Py_IsInitialized()) {  // a node may be freed on a thread without the interpreter lock
      py::gil_scoped_acquire gil;
      Py_DECREF(call_);
    }
  }

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    py::gil_scoped_acquire gil;
    // python_error keeps the Python exception for autograd to raise as it is in the caller's thread.
    if (!py::reinterpret_steal<py::object>(PyObject_CallNoArgs(call_))) throw python_error();
    return grads;
  }

 private:
  PyObject* call_;  // owned
};

// What autograd holds for `t`, offloaded in span `entry` of `group` (`native` its core) at handle
// `slot`; `offset`: where `t` starts in its storage (bytes).
py::object saved_activation(const py::object& group, ActivationGroup* native, int64_t entry, int64_t slot,
                            const at::Tensor& t, int64_t offset) {
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  return activation::make_saved_activation(SavedActivation{group, native, entry, slot, t.scalar_type(),
                                                           activation::Dims(sizes.begin(), sizes.end()),
                                                           activation::Dims(strides.begin(), strides.end()), offset});
}

// A storage whose span a group of this forward copies: later views of it share the span.
struct StorageEntry {
  py::object group;  // holds `native` alive
  ActivationGroup* native;
  int64_t entry;  // index of its span in the group
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // a freed storage's address may be reused
};

// The twin of pack_table.py's `PackTable`: the open group and, per forward, the storages
// copied so far and those that stay (parameters, buffers, the forward's inputs).
class PackTable {
 public:
  PackTable(const py::object& engine, int64_t min_bytes, c10::Device device, bool on_accel)
      : engine_(py::reinterpret_steal<py::object>(PyWeakref_NewRef(engine.ptr(), nullptr))),
        min_bytes_(min_bytes),
        device_(device),
        on_accel_(on_accel),
        cycle_(device, on_accel) {
    if (!engine_) throw py::error_already_set();
  }

  // A group's cycle runs in native code (group_cycle.h): the engine's plain configuration.
  GroupCycle& cycle() { return cycle_; }
  py::object engine_object() const { return engine(); }
  // The engine, or None where it was freed (a hook on a gradient outliving its handle).
  py::object engine_if_alive() const { return activation::deref(engine_); }

  bool params_pending = false;  // iterables of tensors wait to join param_ptrs (Note [parameter walk])
  bool params_needed = false;  // a saved tensor of this forward needed param_ptrs

  py::object open_group() const { return open_group_; }

  // Opens `group` (None: none open). What the pack reads of its auto-mode state and part
  // ends is read here, once: the engine sets them before it opens the group.
  void set_open_group(const py::object& group) {
    const activation::EngineNames& n = activation::engine_names();
    open_group_ = group;
    open_native_ = nullptr;
    cap_ = -1;
    span_ends_ = py::none();
    profile_ = py::none();
    split_ends_.clear();
    part_ = 0;
    if (group.is_none()) return;
    if (!py::isinstance<ActivationGroup>(group)) {
      throw py::type_error(std::string("offload._C.PackTable.open_group: expected a group of the core "
                                       "(offload._C.ActivationGroup) or None, got ") + Py_TYPE(group.ptr())->tp_name);
    }
    open_native_ = group.cast<ActivationGroup*>();
    const py::object& state = open_native_->auto_state;
    has_auto_ = !state.is_none();
    if (has_auto_) {
      const py::object cap = attr(state, n.cap);
      if (!cap.is_none()) cap_ = cap.cast<int64_t>();
      span_ends_ = attr(state, n.span_ends);
      profile_ = attr(state, n.profile);
    }
    if (!open_native_->split.is_none()) split_ends_ = open_native_->split.cast<std::vector<int64_t>>();
    part_ = open_native_->part;
  }

  // The storages of `tensors` (parameters, buffers, inputs: any iterable) stay: saved_tensors.py's
  // `storage_ptrs` in C, a walk each forward that needs it (Note [parameter walk]), where Python
  // would make a storage object per tensor.
  void add_params(const py::iterable& tensors) {
    for (const py::handle item : tensors) add_param(item);
  }

  // The storages of `root`'s parameters and buffers and its submodules' stay: saved_tensors.py's
  // `module_tensors` walk in C, over the modules' own dicts (a module reached twice is read
  // once), without a Python generator frame per module and tensor.
  void add_module_params(const py::handle& root) {
    static PyObject* modules_name = PyUnicode_InternFromString("_modules");
    static PyObject* parameters_name = PyUnicode_InternFromString("_parameters");
    static PyObject* buffers_name = PyUnicode_InternFromString("_buffers");
    std::vector<py::object> stack{py::reinterpret_borrow<py::object>(root)};
    std::unordered_set<PyObject*> seen;  // the stack and the tree hold every module while we walk
    while (!stack.empty()) {
      const py::object module = std::move(stack.back());
      stack.pop_back();
      if (!seen.insert(module.ptr()).second) continue;
      for (PyObject* name : {parameters_name, buffers_name}) {
        const py::object members = attr(module, name);
        if (!PyDict_Check(members.ptr())) continue;
        PyObject* key = nullptr;
        PyObject* value = nullptr;  // borrowed
        Py_ssize_t pos = 0;
        while (PyDict_Next(members.ptr(), &pos, &key, &value)) add_param(value);
      }
      const py::object children = attr(module, modules_name);
      if (!PyDict_Check(children.ptr())) continue;
      PyObject* key = nullptr;
      PyObject* child = nullptr;
      Py_ssize_t pos = 0;
      while (PyDict_Next(children.ptr(), &pos, &key, &child)) {
        if (child != Py_None) stack.push_back(py::reinterpret_borrow<py::object>(child));
      }
    }
  }

  // forward.py's `boundary` in the plain configuration (group_cycle.h): the open group closes
  // (or a small layer joins it) and the next one opens.
  void boundary(const py::object& name, bool offload, const py::object& layer) {
    const py::object engine = this->engine();
    const py::object group = open_group_;
    ActivationGroup* g = open_native_;
    bool joined = false;
    py::object next = cycle_.next_group(engine, group, g, name, offload, layer, &joined);
    if (joined) return;
    set_open_group(py::none());
    cycle_.close_left(engine, group, g, name, layer);
    if (!next.is_none()) set_open_group(next);
    cycle_.follow_hooks(engine, !next.is_none());
  }

  // call() when backward computes the gradient of `tensor`; false where it has no node to
  // hook (a leaf), which the engine hooks in Python.
  static bool call_on_gradient(const at::Tensor& tensor, py::object call) {
    const auto& node = tensor.grad_fn();
    if (node.get() == nullptr) return false;
    node->add_pre_hook(std::make_unique<CallOnGradient>(std::move(call)));
    return true;
  }

  // The storage at `ptr` is among the storages that stay (walked so far).
  bool holds_param(int64_t ptr) const { return param_ptrs_.count(ptr) > 0; }

  size_t size() const { return storages_.size(); }  // the storages recorded in this forward

  void clear() {
    storages_.clear();
    param_ptrs_.clear();
  }

  py::object pack(py::handle tensor);
  py::object unpack(py::handle packed);

 private:
  py::object engine() const {
    py::object engine = engine_if_alive();
    if (engine.is_none()) throw std::runtime_error("offload: the activation engine of these hooks was freed");
    return engine;
  }

  // The consumer's stream: the current stream of the engine's device (none on the host).
  c10::optional<c10::Stream> current_stream() const {
    if (!on_accel_) return c10::nullopt;
    return c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_);
  }

  py::object pack_new_span(py::handle engine, py::handle tensor, const at::Tensor& t, const Extent& extent);

  // The open group passed a part end of its layer (Note [layer parts] in engine.py): the next
  // part opens and the group closes, here where the cycle is native, else by forward.py's `split`.
  void split_open_group(py::handle engine) {
    if (!cycle_.native) {
      call(engine, activation::engine_names().split, open_group_);
      return;
    }
    const py::object group = open_group_;
    ActivationGroup& g = *open_native_;
    set_open_group(cycle_.next_part(engine, g, split_ends_));  // read before the new group replaces them
    cycle_.close(engine, group, g);
  }

  // One parameter, buffer or input: its storage stays. A DTensor counts by its local shard; a
  // tensor without storage (meta, fake) and anything not a tensor (None) are skipped.
  void add_param(const py::handle& item) {
    static PyObject* local_name = PyUnicode_InternFromString("_local_tensor");
    if (!THPVariable_Check(item.ptr())) return;
    int64_t ptr = storage_ptr(THPVariable_Unpack(item.ptr()));
    if (ptr == 0 && !THPVariable_CheckExact(item.ptr()) && PyObject_HasAttr(item.ptr(), local_name)) {
      const py::object local = attr(item, local_name);  // a DTensor: its local shard's storage
      if (THPVariable_Check(local.ptr())) ptr = storage_ptr(THPVariable_Unpack(local.ptr()));
    }
    if (ptr != 0) param_ptrs_.insert(ptr);
  }

  py::object engine_;  // a weak reference: the engine holds the table
  int64_t min_bytes_;
  c10::Device device_;
  bool on_accel_;
  py::object open_group_ = py::none();
  ActivationGroup* open_native_ = nullptr;
  bool has_auto_ = false;
  int64_t cap_ = -1;  // bytes of new spans the open group may offload (auto mode's), -1: no limit
  py::object span_ends_ = py::none();  // auto mode measuring: a list the pack appends to
  py::object profile_ = py::none();  // auto mode measuring: ascending marks the engine pops
  std::vector<int64_t> split_ends_;  // the open group's layer's part ends (Note [layer parts])
  int64_t part_ = 0;
  std::unordered_set<int64_t> param_ptrs_;
  std::unordered_map<int64_t, StorageEntry> storages_;
  GroupCycle cycle_;
};

// A span new to this forward (engine.py's Note [storages and views]): its bytes, auto
// mode's cap and measurements, the part ends.
py::object PackTable::pack_new_span(py::handle engine, py::handle tensor, const at::Tensor& t,
                                    const Extent& extent) {
  const activation::EngineNames& n = activation::engine_names();
  ActivationGroup& group = *open_native_;
  const auto storage = t.storage();
  int64_t lo = extent.first - extent.first % kSpanAlign;
  int64_t hi = extent.last;
  const auto size = static_cast<int64_t>(storage.nbytes());
  if (7 * size <= 8 * (hi - lo)) {  // pack_table.py's WHOLE_STORAGE: 7/8 of it or more, all of it
    lo = 0;
    hi = size;
  }
  const int64_t span_bytes = hi - lo;
  if (has_auto_) {
    if (cap_ >= 0 && group.capped + span_bytes > cap_) return keep(engine, tensor);  // offloaded in part
    if (!span_ends_.is_none()) {
      if (PyList_Append(span_ends_.ptr(), py::int_(group.capped + span_bytes).ptr()) < 0) {
        throw py::error_already_set();
      }
    }
  }
  group.capped += span_bytes;
  group.new_spans += 1;
  if (has_auto_ && !profile_.is_none() && PyList_GET_SIZE(profile_.ptr()) > 0 &&
      group.capped >= py::reinterpret_borrow<py::object>(PyList_GET_ITEM(profile_.ptr(), 0)).cast<int64_t>()) {
    call(engine, n.profiled, open_group_);
  }
  const bool split = part_ < static_cast<int64_t>(split_ends_.size()) &&
                     group.capped >= split_ends_[static_cast<size_t>(part_)];
  const auto entry = static_cast<int64_t>(group.spans.size());
  group.spans.push_back(SavedSpan{t, lo, hi});
  storages_.insert_or_assign(extent.ptr, StorageEntry{open_group_, open_native_, entry, storage.getWeakStorageImpl()});
  const int64_t slot = group.hold(py::reinterpret_borrow<py::object>(tensor), t._version());
  py::object packed = saved_activation(open_group_, open_native_, entry, slot, t, extent.first);
  if (split) split_open_group(engine);  // copy what the layer saved so far, go on in a new group
  return packed;
}

py::object PackTable::pack(py::handle tensor) {
  const activation::EngineNames& n = activation::engine_names();
  const py::object engine = this->engine();
  if (open_group_.is_none() || !THPVariable_Check(tensor.ptr())) {
    return call(engine, n.pack, tensor);  // the tail's count, or not a tensor at all: Python decides
  }
  if (!THPVariable_CheckExact(tensor.ptr())) return keep(engine, tensor);  // parameters, DTensors
  const at::Tensor& t = THPVariable_Unpack(tensor.ptr());
  Extent extent{};
  if (!offload_extent_of(t, min_bytes_, device_, &extent)) return keep(engine, tensor);
  const auto hit = storages_.find(extent.ptr);
  const bool live = hit != storages_.end() && !hit->second.storage.expired();  // saved earlier in this forward
  if (extent.check_params && !live) {  // pack_table.py's `pack_extent` says why only these
    params_needed = true;
    if (params_pending && !param_ptrs_.count(extent.ptr)) call(engine, n.walk_params, py::int_(extent.ptr));
    if (param_ptrs_.count(extent.ptr)) return keep(engine, tensor);
  }
  if (live) {
    StorageEntry& seen = hit->second;
    ActivationGroup& owner = *seen.native;
    if (seen.native == open_native_) {  // the group still collecting: widen the span to cover this view
      SavedSpan& span = owner.spans[static_cast<size_t>(seen.entry)];
      if (extent.first < span.lo || extent.last > span.hi) {
        span.lo = std::min(span.lo, extent.first - extent.first % kSpanAlign);
        span.hi = std::max(span.hi, extent.last);
      }
    } else {
      // Its copy is queued: share it if it holds these bytes, unchanged; else a span of its own.
      const bool shared = owner.state == kCopying && owner.has_spans && [&] {
        const SavedSpan& span = owner.spans[static_cast<size_t>(seen.entry)];
        return span.lo <= extent.first && extent.last <= span.hi && span.version == t._version();
      }();
      if (!shared && extent.check_params) return keep(engine, tensor);  // Note [shared constants] in engine.py
      if (!shared) return pack_new_span(engine, tensor, t, extent);
    }
    const int64_t slot = owner.hold(py::reinterpret_borrow<py::object>(tensor), t._version());
    return saved_activation(seen.group, seen.native, seen.entry, slot, t, extent.first);
  }
  return pack_new_span(engine, tensor, t, extent);
}

py::object PackTable::unpack(py::handle packed) {
  const activation::EngineNames& n = activation::engine_names();
  const py::object engine = this->engine();
  PyObject* obj = packed.ptr();
  if (PyTuple_CheckExact(obj) && PyTuple_GET_SIZE(obj) == 2 && THPVariable_Check(PyTuple_GET_ITEM(obj, 0)) &&
      truthy(attr(engine, n.backward_seen))) {
    py::handle tensor = PyTuple_GET_ITEM(obj, 0);
    const py::object now = attr(tensor, n.version);
    const int same = PyObject_RichCompareBool(now.ptr(), PyTuple_GET_ITEM(obj, 1), Py_EQ);
    if (same < 0) throw py::error_already_set();
    if (same == 1) return py::reinterpret_borrow<py::object>(tensor);
  }
  const SavedActivation* found = activation::saved_activation_of(obj);
  if (found == nullptr) {
    return call(engine, n.unpack, packed);  // the step's first unpack of a kept tensor, or an error
  }
  const SavedActivation& saved = *found;
  if (!truthy(attr(engine, n.backward_seen))) attr(engine, n.backward_starts)();  // the step's first unpack
  ActivationGroup& group = *saved.native;
  const bool first = group.n_unpacked == 0;
  if (first) {
    const py::object observer = attr(engine, n.observer);
    if (!observer.is_none()) call(observer, n.unpacked, saved.group);
  }
  py::object result;
  if (group.holds_device_tensors) {  // still on the device (copy in flight, or kept)
    result = group.unpack_held(saved);
  } else {
    group.check_not_modified(saved);
    if (group.fetched < group.nbytes_aligned || !group.ready_on(current_stream())) {
      // Fetch what no planned point fetched, wait for it.
      if (cycle_.native) {
        cycle_.make_ready(engine, saved.group, group);
      } else {
        call(engine, n.make_ready, saved.group);
      }
    }
    result = group.restored_view(saved);
  }
  if (first) {
    if (cycle_.native) {
      cycle_.prefetch(engine, saved.group);
    } else {
      call(engine, n.prefetch, saved.group);
    }
  }
  group.n_unpacked += 1;
  if (group.n_unpacked >= group.n_handles && group.state != kKept) {
    if (cycle_.native) {
      cycle_.release(engine, saved.group, group);
    } else {
      call(engine, n.release, saved.group);
    }
  }
  return result;
}

PackTable& table_of(py::handle table, const char* hook) {
  // Per saved tensor: pybind11's isinstance and cast each find the C++ type by hashing its
  // name. An exact instance of the table's Python type (read once) holds its PackTable in
  // pybind11's simple layout (one C++ base, no Python subclass).
  static PyTypeObject* const table_type = reinterpret_cast<PyTypeObject*>(py::type::of<PackTable>().ptr());
  if (Py_TYPE(table.ptr()) == table_type) {
    auto* inst = reinterpret_cast<py::detail::instance*>(table.ptr());
    if (inst->simple_layout && inst->simple_holder_constructed) {
      return *static_cast<PackTable*>(inst->simple_value_holder[0]);
    }
  }
  if (!py::isinstance<PackTable>(table)) {
    throw py::type_error(std::string("offload._C.") + hook + ": table must be an offload._C.PackTable, got " +
                         Py_TYPE(table.ptr())->tp_name);
  }
  return table.cast<PackTable&>();
}

py::object pack_saved_tensor(py::handle table, py::handle tensor) {
  return table_of(table, "pack_saved_tensor").pack(tensor);
}

py::object unpack_saved_tensor(py::handle table, py::handle packed) {
  return table_of(table, "unpack_saved_tensor").unpack(packed);
}

// The hooks as plain C functions taking (engine, x) by the vectorcall protocol: autograd calls
// them once per saved tensor, and a pybind11 function's argument dispatch cost more than the
// rest of a kept tensor's pack.
template <py::object (*Hook)(py::handle, py::handle)>
PyObject* fast_call(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "offload._C hook: expected 2 arguments (table, tensor or packed), got %zd", nargs);
    return nullptr;
  }
  try {
    return Hook(args[0], args[1]).release().ptr();
  } catch (py::error_already_set& e) {  // raised in Python (the engine's methods): as it was
    e.restore();
  } catch (const py::builtin_exception& e) {  // py::type_error and its kin: their Python type
    e.set_error();
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef hook_defs[] = {
    {"pack_saved_tensor", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_call<pack_saved_tensor>)),
     METH_FASTCALL, "The activation engine's pack hook: pack_saved_tensor(table, tensor) (bind its PackTable with "
     "functools.partial)"},
    {"unpack_saved_tensor",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_call<unpack_saved_tensor>)), METH_FASTCALL,
     "The activation engine's unpack hook: unpack_saved_tensor(table, packed) (bind its PackTable with "
     "functools.partial)"},
};

// `group` as the core's group, for the table's method `fn`.
ActivationGroup& core_group(const py::object& group, const char* fn) {
  if (!py::isinstance<ActivationGroup>(group)) {
    throw py::type_error(std::string("offload._C.PackTable.") + fn +
                         ": group must be a group of the core (offload._C.ActivationGroup), got " +
                         Py_TYPE(group.ptr())->tp_name);
  }
  return group.cast<ActivationGroup&>();
}

py::object block_or_none(const at::Tensor& t) {
  return t.defined() ? py::cast(t) : py::none();
}

void bind(py::module_& m) {
  m.def("offload_extent", &offload_extent, py::arg("tensor"), py::arg("min_bytes"), py::arg("device"),
        "Whether the activation engine may offload `tensor` (a plain tensor saved in a group): "
        "None, or (storage data_ptr, first byte, end byte, whether its base has no grad_fn)");
  // groups.py's `Group` is the reference for every member, the engine's per-layer fields
  // (name, layer, prev, part, split, auto, ...: groups.py's `LayerFields`) among them.
  m.def("next_group_serial", &activation::next_group_serial,
        "The next group serial of the process (ActivationEvent.serial), shared by both paths' groups");
  py::class_<ActivationGroup>(m, "ActivationGroup")
      .def(py::init<py::object, py::object, bool, py::object>(), py::arg("name"), py::arg("layer"), py::arg("offload"),
           py::arg("prev"))
      .def_readwrite("name", &ActivationGroup::name)
      .def_readwrite("serial", &ActivationGroup::serial)
      .def_readwrite("layer", &ActivationGroup::layer)
      .def_readwrite("prev", &ActivationGroup::prev)
      .def_readwrite("split", &ActivationGroup::split)
      .def_readwrite("part", &ActivationGroup::part)
      .def_readwrite("continued", &ActivationGroup::continued)
      .def_readwrite("n_layers", &ActivationGroup::n_layers)
      .def_readwrite("auto", &ActivationGroup::auto_state)
      .def_readwrite("checksums", &ActivationGroup::checksums)
      .def_readwrite("state", &ActivationGroup::state)
      .def_readwrite("n_handles", &ActivationGroup::n_handles)
      .def_readwrite("n_unpacked", &ActivationGroup::n_unpacked)
      .def_readwrite("capped", &ActivationGroup::capped)
      .def_readwrite("new_spans", &ActivationGroup::new_spans)
      .def_readwrite("nbytes", &ActivationGroup::nbytes)
      .def_readwrite("nbytes_aligned", &ActivationGroup::nbytes_aligned)
      .def_readwrite("fetched", &ActivationGroup::fetched)
      .def_readonly("holds_device_tensors", &ActivationGroup::holds_device_tensors)
      .def_readonly("has_spans", &ActivationGroup::has_spans)
      .def_property(
          "fetch_stream",
          [](const ActivationGroup& g) { return g.fetch_stream.has_value() ? py::cast(*g.fetch_stream) : py::none(); },
          [](ActivationGroup& g, c10::optional<c10::Stream> stream) { g.fetch_stream = stream; })
      .def("owns_block", &ActivationGroup::owns_block, py::arg("stream"))
      // Its copy out as a CopyHandle (None before its close); a new handle each read, around
      // the one transfer the group holds.
      .def_property(
          "d2h", [](const ActivationGroup& g) { return activation::copy_handle(g.d2h); },
          [](ActivationGroup& g, const py::object& handle) { g.d2h = activation::transfer_of(handle); })
      .def("add_h2d", [](ActivationGroup& g, const py::object& handle) {
        g.h2d.push_back(activation::transfer_of(handle));
      }, py::arg("handle"))
      .def("h2d_handles", [](const ActivationGroup& g) {
        py::list out;
        for (const auto& t : g.h2d) out.append(activation::copy_handle(t));
        return out;
      })
      .def_property(
          "stream", [](const ActivationGroup& g) { return g.stream.has_value() ? py::cast(*g.stream) : py::none(); },
          [](ActivationGroup& g, c10::optional<c10::Stream> stream) { g.stream = stream; })
      .def("saved_on", &ActivationGroup::saved_on, py::arg("stream"))
      .def_property(
          "device_block", [](const ActivationGroup& g) { return block_or_none(g.device_block); },
          [](ActivationGroup& g, c10::optional<at::Tensor> block) { g.device_block = block.value_or(at::Tensor()); })
      .def("seal", &ActivationGroup::seal)
      .def("copy_out", &ActivationGroup::copy_out, py::arg("pool"), py::arg("stream"), py::arg("chunk_bytes"),
           py::arg("timing"))
      .def("drop_spans", &ActivationGroup::drop_spans)
      .def("drop_held", &ActivationGroup::drop_held)
      .def("let_sources_go", &ActivationGroup::let_sources_go, py::arg("stream"))
      .def("reset_restore", &ActivationGroup::reset_restore)
      .def("ready_on", &ActivationGroup::ready_on, py::arg("stream"))
      .def("mark_ready", &ActivationGroup::mark_ready, py::arg("stream"))
      .def("span_bytes", &ActivationGroup::span_bytes)
      .def("span_descriptions", &ActivationGroup::span_descriptions)
      .def("block_spans", &ActivationGroup::block_spans, py::arg("block"));
  activation::add_saved_activation_type(m);
  py::class_<PackTable>(m, "PackTable")
      .def(py::init<const py::object&, int64_t, c10::Device, bool>(), py::arg("engine"), py::arg("min_tensor_bytes"),
           py::arg("device"), py::arg("on_accel"))
      .def_property("open_group", &PackTable::open_group, &PackTable::set_open_group)
      .def_readwrite("params_pending", &PackTable::params_pending)
      .def_readwrite("params_needed", &PackTable::params_needed)
      .def_property(
          "native_cycle", [](PackTable& t) { return t.cycle().native; },
          [](PackTable& t, bool on) { t.cycle().native = on; })
      .def("boundary", &PackTable::boundary, py::arg("name"), py::arg("offload"), py::arg("layer"))
      .def(
          "close_group",
          [](PackTable& t, py::object group) {
            t.cycle().close(t.engine_object(), group, core_group(group, "close_group"));
          },
          py::arg("group"))
      .def(
          "fetch_group",
          [](PackTable& t, py::object group, c10::optional<int64_t> upto) {
            if (upto.has_value() && *upto < 0) {
              throw py::value_error("offload._C.PackTable.fetch_group: expected upto >= 0 or None, got " +
                                    std::to_string(*upto));
            }
            t.cycle().fetch(t.engine_object(), core_group(group, "fetch_group"), upto.value_or(-1));
          },
          py::arg("group"), py::arg("upto") = py::none())
      .def(
          "release_due", [](PackTable& t, const py::object& point) { t.cycle().release_due(t.engine_object(), point); },
          py::arg("point"))
      .def(
          "fetch_layers",
          [](PackTable& t, const py::list& fetches) {
            // Per layer: (weak references to its groups, the share of their bytes or None).
            const py::object engine = t.engine_if_alive();
            if (engine.is_none()) return;
            for (const py::handle entry : fetches) {
              const py::tuple pair = py::reinterpret_borrow<py::tuple>(entry);
              t.cycle().fetch_groups(engine, pair[0], pair[1]);
            }
          },
          py::arg("fetches"))
      .def(
          "configure_backward",
          [](PackTable& t, py::object pool, py::object handle_class, int64_t small_bytes, int64_t chunk_bytes,
             const py::object& timings, bool first_layer_parts) {
            t.cycle().configure(std::move(pool), std::move(handle_class), small_bytes, chunk_bytes, timings,
                                first_layer_parts);
          },
          py::arg("pool"), py::arg("handle_class"), py::arg("small_bytes"), py::arg("chunk_bytes"), py::arg("timings"),
          py::arg("first_layer_parts"))
      .def("add_params", &PackTable::add_params, py::arg("tensors"))
      .def("add_module_params", &PackTable::add_module_params, py::arg("root"))
      .def("holds_param", &PackTable::holds_param, py::arg("ptr"))
      .def_static("call_on_gradient", &PackTable::call_on_gradient, py::arg("tensor"), py::arg("call"))
      .def("__len__", &PackTable::size)
      .def("clear", &PackTable::clear);
  for (PyMethodDef& def : hook_defs) {
    PyObject* fn = PyCFunction_NewEx(&def, nullptr, m.attr("__name__").ptr());
    if (fn == nullptr) throw py::error_already_set();
    m.add_object(def.ml_name, py::reinterpret_steal<py::object>(fn));
  }
}

}  // namespace

OFFLOAD_REGISTER_BINDINGS(saved_tensor_hooks, bind);

}  // namespace offload
