// ActivationGroup: a group's spans, held tensors and restored views (activation_group.h
// says what runs here and what stays in Python). Each method is the twin of the same
// method of groups.py's `Group`; the reasons are the notes of engine.py named there.
#include "activation_group.h"

#include <algorithm>
#include <string>
#include <utility>

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/DynamicTypes.h>

namespace offload {
namespace activation {

std::string describe(at::ScalarType dtype, at::IntArrayRef size) {
  // The dtype as Python names it (str(torch.float32) is "torch.float32"), only on an error's path.
  std::string name = py::str(reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype)));
  if (name.rfind("torch.", 0) == 0) name = name.substr(6);
  std::string out = name + " [";
  for (size_t d = 0; d < size.size(); ++d) out += (d ? ", " : "") + std::to_string(size[d]);
  return out + "]";
}

void raise_modified(const std::string& desc, int64_t saved, int64_t now) {
  const std::string message =
      "one of the variables needed for gradient computation has been modified by an inplace operation: [" + desc +
      "] is at version " + std::to_string(now) + "; expected version " + std::to_string(saved) +
      " instead (offload.activation: the tensor was modified after autograd saved it)";
  PyErr_SetString(PyExc_RuntimeError, message.c_str());
  throw py::error_already_set();
}

namespace {
py::object* handle_class = nullptr;  // never freed: the module lives as long as the interpreter

struct SavedActivationObject {
  PyObject_HEAD
  SavedActivation value;
};

void saved_activation_dealloc(PyObject* self) {
  reinterpret_cast<SavedActivationObject*>(self)->value.~SavedActivation();
  Py_TYPE(self)->tp_free(self);
}

PyObject* saved_activation_group(PyObject* self, void* /*closure*/) {
  PyObject* group = reinterpret_cast<SavedActivationObject*>(self)->value.group.ptr();
  Py_INCREF(group);
  return group;
}

PyObject* saved_activation_slot(PyObject* self, void* /*closure*/) {
  return PyLong_FromLongLong(reinterpret_cast<SavedActivationObject*>(self)->value.slot);
}

PyGetSetDef saved_activation_getset[] = {
    {"group", saved_activation_group, nullptr, "the group it belongs to", nullptr},
    {"slot", saved_activation_slot, nullptr, "its handle slot in the group", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject saved_activation_type = [] {
  PyTypeObject type{PyVarObject_HEAD_INIT(nullptr, 0)};
  type.tp_name = "offload._C.SavedActivation";
  type.tp_basicsize = sizeof(SavedActivationObject);
  type.tp_dealloc = saved_activation_dealloc;
  type.tp_flags = Py_TPFLAGS_DEFAULT;
  type.tp_doc = "What autograd holds for a tensor the activation engine offloads (made by the core's pack hook)";
  type.tp_getset = saved_activation_getset;
  return type;
}();
}  // namespace

py::object make_saved_activation(SavedActivation&& value) {
  PyObject* obj = saved_activation_type.tp_alloc(&saved_activation_type, 0);
  if (obj == nullptr) throw py::error_already_set();
  new (&reinterpret_cast<SavedActivationObject*>(obj)->value) SavedActivation(std::move(value));
  return py::reinterpret_steal<py::object>(obj);
}

const SavedActivation* saved_activation_of(PyObject* obj) {
  if (Py_TYPE(obj) != &saved_activation_type) return nullptr;
  return &reinterpret_cast<SavedActivationObject*>(obj)->value;
}

void add_saved_activation_type(py::module_& m) {
  if (PyType_Ready(&saved_activation_type) < 0) throw py::error_already_set();
  Py_INCREF(&saved_activation_type);
  m.add_object("SavedActivation",
               py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&saved_activation_type)));
}

void set_copy_handle_class(py::object cls) {
  if (handle_class == nullptr) handle_class = new py::object();
  *handle_class = std::move(cls);
}

py::object copy_handle(const std::shared_ptr<Transfer>& transfer) {
  if (transfer == nullptr) return py::none();
  TORCH_CHECK(handle_class != nullptr && !handle_class->is_none(),
              "offload: the core's groups are used before the engine gave them offload.core.copy.CopyHandle");
  return (*handle_class)(py::cast(transfer));
}

std::shared_ptr<Transfer> transfer_of(const py::object& handle) {
  if (handle.is_none()) return nullptr;
  static PyObject* impl = PyUnicode_InternFromString("_impl");
  PyObject* value = PyObject_GetAttr(handle.ptr(), impl);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value).cast<std::shared_ptr<Transfer>>();
}

int64_t next_group_serial() {
  static int64_t next = 0;  // read and bumped with the interpreter lock held
  return next++;
}

ActivationGroup::ActivationGroup(py::object name, py::object layer, bool offload, py::object prev)
    : state(offload ? kOpen : kKept),
      name(std::move(name)),
      serial(next_group_serial()),
      layer(std::move(layer)),
      prev(std::move(prev)),
      split(py::none()),
      auto_state(py::none()),
      checksums(py::none()) {}

int64_t ActivationGroup::hold(const py::object& tensor, int64_t version) {
  held.push_back(HeldTensor{tensor, version});
  n_handles += 1;
  return static_cast<int64_t>(held.size()) - 1;
}

int64_t ActivationGroup::seal() {
  span_starts_.clear();
  span_starts_.reserve(spans.size());
  for (SavedSpan& span : spans) {
    span_starts_.push_back(span.lo);
    nbytes += span.hi - span.lo;
    span.version = span.tensor._version();
  }
  return static_cast<int64_t>(spans.size());
}

std::shared_ptr<Transfer> ActivationGroup::copy_out(HostPool& pool, const c10::optional<c10::Stream>& stream,
                                                    int64_t chunk_bytes, bool timing) {
  // One pooled host block per group, spans at aligned offsets (Note [one copy per group]).
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> sizes;
  tensors.reserve(spans.size());
  sizes.reserve(spans.size());
  offsets_.clear();
  int64_t at = 0;
  for (const SavedSpan& span : spans) {
    tensors.push_back(span.tensor);
    sizes.push_back(span.hi - span.lo);
    offsets_.push_back(at);
    at += span_aligned(span.hi - span.lo);
  }
  nbytes_aligned = at;
  sizes_ = sizes;
  CopyOptions options;
  options.require_pinned = true;
  options.small_bytes = 0;
  options.chunk_bytes = chunk_bytes;
  options.timing = timing;
  release_finished_copies();  // what earlier copies left, dropped with the interpreter lock held
  py::gil_scoped_release no_gil;
  return copy_spans_to_host(tensors, span_starts_, sizes, at::Tensor(), nbytes_aligned, offsets_, pool, stream,
                            options);
}

std::vector<at::Tensor> ActivationGroup::span_bytes() const {
  std::vector<at::Tensor> out;
  for (const SavedSpan& span : spans) {
    const auto options = at::TensorOptions().dtype(at::kByte).device(span.tensor.device());
    out.push_back(at::empty({0}, options).set_(span.tensor.storage(), span.lo, {span.hi - span.lo}, {1}));
  }
  return out;
}

std::vector<std::string> ActivationGroup::span_descriptions() const {
  std::vector<std::string> out;
  for (const SavedSpan& span : spans) out.push_back(describe(span.tensor.scalar_type(), span.tensor.sizes()));
  return out;
}

std::vector<at::Tensor> ActivationGroup::block_spans(const at::Tensor& block) const {
  TORCH_CHECK(offsets_.size() == span_starts_.size() && spans.size() <= offsets_.size(),
              "offload: a group's block spans are read before its copy out");
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < offsets_.size(); ++i) out.push_back(block.narrow(0, offsets_[i], sizes_[i]));
  return out;
}

void ActivationGroup::drop_spans() {
  spans.clear();
  spans.shrink_to_fit();
  has_spans = false;
}

void ActivationGroup::drop_held() {
  // saved_tensors.py's `drop_held` gives the reasons: a watch on the version counter only
  // for a tensor something else still reaches (a view, or one referenced beyond the group's
  // own slots), so an in-place change after this point still raises at unpack. Python keeps
  // an alias tensor for it (a detached tensor with no storage that shares the counter); here
  // the counter itself is kept, which holds no tensor and costs no allocation.
  if (!holds_device_tensors) return;
  holds_device_tensors = false;
  drop_spans();
  watch_.assign(held.size(), {c10::VariableVersion(c10::VariableVersion::DISABLED), -1});
  modified_.clear();
  std::unordered_map<PyObject*, Py_ssize_t> slots_of;  // filled only if a tensor needs it
  for (size_t slot = 0; slot < held.size(); ++slot) {
    const HeldTensor& h = held[slot];
    const at::Tensor& t = THPVariable_Unpack(h.tensor.ptr());
    const int64_t now = t._version();
    bool watch = false;
    if (now != h.version) {
      modified_.emplace(static_cast<int64_t>(slot), std::make_tuple(describe(t.scalar_type(), t.sizes()),
                                                                    h.version, now));
    } else if (t.is_view()) {
      watch = true;
    } else {
      const Py_ssize_t refs = Py_REFCNT(h.tensor.ptr());  // the group's slots hold one each
      if (refs > 1) {
        if (slots_of.empty()) {
          for (const HeldTensor& other : held) slots_of[other.tensor.ptr()] += 1;
        }
        watch = refs > slots_of[h.tensor.ptr()];
      }
    }
    if (watch) watch_[slot] = {t.unsafeGetTensorImpl()->version_counter(), h.version};
  }
  held.clear();
  held.shrink_to_fit();
}

void ActivationGroup::let_sources_go(const c10::Stream& stream) {
  for (const SavedSpan& span : spans) span.tensor.record_stream(stream);
}

void ActivationGroup::reset_restore() {
  device_block = at::Tensor();
  fetch_stream = c10::nullopt;
  h2d.clear();
  typed_blocks_.clear();
  views_.clear();
  ready_streams_.clear();
  ready_on_host_ = false;
  fetched = 0;
  n_unpacked = 0;
}

bool ActivationGroup::ready_on(const c10::optional<c10::Stream>& stream) const {
  if (!stream.has_value()) return ready_on_host_;
  return std::find(ready_streams_.begin(), ready_streams_.end(), *stream) != ready_streams_.end();
}

bool ActivationGroup::mark_ready(const c10::optional<c10::Stream>& stream) {
  const bool first = !ready_on_host_ && ready_streams_.empty();
  if (stream.has_value()) {
    if (!ready_on(stream)) ready_streams_.push_back(*stream);
  } else {
    ready_on_host_ = true;
  }
  return first;
}

void ActivationGroup::check_not_modified(const SavedActivation& packed) const {
  const auto found = modified_.find(packed.slot);
  if (found != modified_.end()) {
    raise_modified(std::get<0>(found->second), std::get<1>(found->second), std::get<2>(found->second));
  }
  const auto& watch = watch_[static_cast<size_t>(packed.slot)];
  if (watch.second >= 0 && watch.first.current_version() != static_cast<uint32_t>(watch.second)) {
    raise_modified(describe(packed.dtype, packed.size), watch.second, watch.first.current_version());
  }
}

py::object ActivationGroup::restored_view(const SavedActivation& packed) {
  for (const RestoredView& v : views_) {
    if (v.entry == packed.entry && v.dtype == packed.dtype && v.offset == packed.offset && v.size == packed.size &&
        v.stride == packed.stride) {
      return v.tensor;  // the same view saved twice comes back as the same tensor
    }
  }
  TORCH_CHECK(device_block.defined(), "offload: a group's restored block is missing at unpack (the engine did not "
              "fetch it)");
  // One op per view: as_strided on the block viewed as the dtype (made once per dtype), at
  // the span's place in the block plus the view's bytes past the span's start. Whole
  // elements: spans start on kSpanAlign boundaries, which every itemsize divides.
  const at::Tensor* typed = nullptr;
  for (const auto& entry : typed_blocks_) {
    if (entry.first == packed.dtype) typed = &entry.second;
  }
  if (typed == nullptr) {
    typed_blocks_.emplace_back(packed.dtype, device_block.view(packed.dtype));
    typed = &typed_blocks_.back().second;
  }
  const auto entry = static_cast<size_t>(packed.entry);
  const int64_t at = offsets_[entry] + packed.offset - span_starts_[entry];
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(packed.dtype));
  at::Tensor view = typed->as_strided(packed.size, packed.stride, at / itemsize);
  py::object tensor = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(view)));
  if (!tensor) throw py::error_already_set();
  views_.push_back(RestoredView{packed.entry, packed.dtype, packed.size, packed.stride, packed.offset, tensor});
  return tensor;
}

py::object ActivationGroup::unpack_held(const SavedActivation& packed) const {
  const HeldTensor& h = held[static_cast<size_t>(packed.slot)];
  const at::Tensor& t = THPVariable_Unpack(h.tensor.ptr());
  const int64_t now = t._version();
  if (now != h.version) raise_modified(describe(t.scalar_type(), t.sizes()), h.version, now);
  return h.tensor;
}

}  // namespace activation
}  // namespace offload
