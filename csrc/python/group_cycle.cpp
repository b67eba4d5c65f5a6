// GroupCycle: a group's backward in native code (group_cycle.h says when it runs).
// Each method is the twin of the method of offload/activation/backward.py named in
// its comment, for the plain configuration; a test holds the two paths equal
// (gradients, statistics, events of the steps around them).
#include "group_cycle.h"

#include <chrono>
#include <vector>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "offload/transfer.h"

namespace offload {
namespace activation {

namespace {

// The Python attributes read here, interned once (a lookup by a C string makes a str each time).
struct CycleNames {
  PyObject* counters = PyUnicode_InternFromString("counters");
  PyObject* prev = PyUnicode_InternFromString("prev");
  PyObject* continued = PyUnicode_InternFromString("continued");
  PyObject* timings = PyUnicode_InternFromString("_timings");
  PyObject* copy = PyUnicode_InternFromString("copy");
  PyObject* copy_streams = PyUnicode_InternFromString("_copy_streams");
  PyObject* timed_start = PyUnicode_InternFromString("_timed_start");
  PyObject* timed_end = PyUnicode_InternFromString("_timed_end");
  PyObject* fetch_in_python = PyUnicode_InternFromString("_fetch_group");
  PyObject* stream_object = PyUnicode_InternFromString("_current_stream");
  PyObject* h2d_bytes = PyUnicode_InternFromString("h2d_bytes");
  PyObject* h2d_seconds = PyUnicode_InternFromString("h2d_seconds");
  PyObject* groups_fetched = PyUnicode_InternFromString("groups_fetched");
  PyObject* groups_prefetched = PyUnicode_InternFromString("groups_prefetched");
  PyObject* backward_wait_seconds = PyUnicode_InternFromString("backward_wait_seconds");
  PyObject* forward_wait_seconds = PyUnicode_InternFromString("forward_wait_seconds");
  PyObject* layer = PyUnicode_InternFromString("layer");
  PyObject* layer_sizes = PyUnicode_InternFromString("_layer_sizes");
  PyObject* inflight = PyUnicode_InternFromString("_inflight");
  PyObject* popleft = PyUnicode_InternFromString("popleft");
  PyObject* resident_groups = PyUnicode_InternFromString("resident_groups");
  PyObject* keep_on_device = PyUnicode_InternFromString("_keep_on_device");
  PyObject* n_layers = PyUnicode_InternFromString("n_layers");
  PyObject* d2h_bytes = PyUnicode_InternFromString("d2h_bytes");
  PyObject* groups_offloaded = PyUnicode_InternFromString("groups_offloaded");
  PyObject* layers_offloaded = PyUnicode_InternFromString("layers_offloaded");
  PyObject* tensors_offloaded = PyUnicode_InternFromString("tensors_offloaded");
  PyObject* capturing = PyUnicode_InternFromString("capturing");
  PyObject* min_group_bytes = PyUnicode_InternFromString("min_group_bytes");
  PyObject* layer_groups = PyUnicode_InternFromString("_layer_groups");
  PyObject* last_offloaded = PyUnicode_InternFromString("_last_offloaded");
  PyObject* hooks_in_groups_only = PyUnicode_InternFromString("hooks_in_groups_only");
  PyObject* hooks_on = PyUnicode_InternFromString("_hooks_on");
  PyObject* tail = PyUnicode_InternFromString("_tail");
  PyObject* hooks_follow_groups = PyUnicode_InternFromString("_hooks_follow_groups");
  PyObject* schedule = PyUnicode_InternFromString("schedule");
  PyObject* release_at = PyUnicode_InternFromString("release_at");
  PyObject* due = PyUnicode_InternFromString("_due");
  PyObject* release_due = PyUnicode_InternFromString("_release_due");
  PyObject* tail_save = PyUnicode_InternFromString("tail_save");
  PyObject* caps = PyUnicode_InternFromString("caps");
  PyObject* split_at = PyUnicode_InternFromString("split_at");
  PyObject* cap = PyUnicode_InternFromString("cap");
};

// groups.py's AutoState, the class of a group's auto-mode state (read once).
const py::object& auto_state_class() {
  static py::object* cls = new py::object(py::module_::import("offload.activation.groups").attr("AutoState"));
  return *cls;
}

// dict.get(key) of a Python dict (None where it is missing).
py::object dict_get(const py::object& dict, const py::object& key) {
  PyObject* value = PyDict_GetItemWithError(dict.ptr(), key.ptr());  // borrowed
  if (value == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return py::none();
  }
  return py::reinterpret_borrow<py::object>(value);
}

// engine.py's SPLIT_PARTS: the forward's first offloaded layer in async mode is copied in this
// many parts (Note [layer parts]).
constexpr int64_t kSplitParts = 4;

const CycleNames& cycle_names() {
  static const CycleNames* interned = new CycleNames();  // lives as long as the interpreter
  return *interned;
}

py::object get(py::handle obj, PyObject* name) {
  PyObject* value = PyObject_GetAttr(obj.ptr(), name);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

// counters[key] += amount (an int counter, or a float one for seconds).
template <typename Number>
void add(py::handle engine, PyObject* key, Number amount) {
  const py::object counters = get(engine, cycle_names().counters);
  PyObject* now = PyDict_GetItemWithError(counters.ptr(), key);  // borrowed
  if (now == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
    throw py::error_already_set();
  }
  const py::object more = py::reinterpret_steal<py::object>(PyNumber_Add(now, py::cast(amount).ptr()));
  if (!more || PyDict_SetItem(counters.ptr(), key, more.ptr()) < 0) throw py::error_already_set();
}

// The group a weak reference (or None) names, or None.
py::object deref(const py::object& ref) {
  if (ref.is_none()) return ref;
  PyObject* target = PyWeakref_GetObject(ref.ptr());  // borrowed
  if (target == nullptr) throw py::error_already_set();
  return py::reinterpret_borrow<py::object>(target);
}

// A group's transfers are never deferred, so a query reads their events and never waits: it
// keeps the interpreter lock (letting it go and taking it back costs more than the query,
// twice a group). A done query drops, with the lock held, what finished copies left (Note
// [dropping tensors] in csrc/core/in_flight.h). A wait lets the lock go, as Transfer's
// Python methods do (copy_engine.cpp).
bool query(const Transfer& t) {
  const bool done = t.query(/*drain=*/false);
  if (done) drain_in_flight();
  return done;
}

void synchronize(const Transfer& t) {
  {
    py::gil_scoped_release no_gil;
    t.synchronize(/*drain=*/false);
  }
  drain_in_flight();
}

}  // namespace

void GroupCycle::configure(py::object pool_owner, py::object handle_class, int64_t small_bytes, int64_t chunk_bytes,
                           bool timing, bool first_layer_parts) {
  first_layer_parts_ = first_layer_parts;
  pool_ = &pool_owner.cast<HostPool&>();
  pool_owner_ = std::move(pool_owner);
  set_copy_handle_class(std::move(handle_class));
  small_bytes_ = small_bytes;
  chunk_bytes_ = chunk_bytes;
  timing_ = timing;
}

c10::optional<c10::Stream> GroupCycle::current_stream() const {
  if (!on_accel_) return c10::nullopt;
  return c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_);
}

void GroupCycle::read_copy_streams(py::handle engine) {
  if (streams_read_) return;
  const py::tuple streams = get(engine, cycle_names().copy_streams)().cast<py::tuple>();  // engine.py's `_copy_streams`
  d2h_stream_ = streams[0].cast<c10::optional<c10::Stream>>();
  h2d_stream_ = streams[1].cast<c10::optional<c10::Stream>>();
  streams_read_ = true;
}

py::object GroupCycle::timed_start(py::handle engine) {
  // Through the engine's own timing (step_stats.py): its events and the step's pending list.
  if (!timing_) return py::none();
  const CycleNames& n = cycle_names();
  return get(engine, n.timed_start)(get(engine, n.stream_object)());
}

void GroupCycle::timed_end(py::handle engine, const char* kind, const py::object& start) {
  if (start.is_none()) return;
  const CycleNames& n = cycle_names();
  get(engine, n.timed_end)(kind, start, get(engine, n.stream_object)());
}

// backward.py's `fetch` of a whole group (`upto` None): one copy back of its host block
// into a device block laid out as it.
void GroupCycle::fetch(py::handle engine, py::handle group, ActivationGroup& g) {
  const CycleNames& n = cycle_names();
  const int64_t end = g.nbytes_aligned;
  if (end <= g.fetched) return;
  if (g.fetched != 0) {  // a piece was fetched (a plan's, Note [fetch in pieces]): the rest as Python does it
    get(engine, n.fetch_in_python)(group);
    return;
  }
  read_copy_streams(engine);
  const std::shared_ptr<Transfer> source = g.d2h;
  TORCH_CHECK(source != nullptr, "offload: a group is fetched back before its copy out was issued");
  if (!g.device_block.defined()) {
    // Allocated on the consumer's (current) stream, its owner (Note [backward] in engine.py).
    g.device_block = at::empty({g.nbytes_aligned}, at::TensorOptions().dtype(at::kByte).device(device_));
    g.fetch_stream = current_stream();
  }
  CopyOptions options;
  options.require_pinned = true;
  options.small_bytes = small_bytes_;
  options.chunk_bytes = chunk_bytes_;
  options.timing = timing_;
  const c10::optional<std::vector<at::Tensor>> out{std::vector<at::Tensor>{g.device_block}};
  release_finished_copies();  // what earlier copies left, dropped with the interpreter lock held
  std::shared_ptr<Transfer> back;
  {
    py::gil_scoped_release no_gil;
    // From the copy out's transfer: the copy stream also waits for that copy (a group let
    // go at a release point was seen complete on the device only), and times after both waits.
    back = copy_to_device(source->tensors(), source, device_, *pool_, h2d_stream_, out, options);
  }
  g.h2d.push_back(back);
  if (timing_) {
    const py::object counters = get(engine, n.counters);
    get(get(engine, n.timings), n.copy)(counters, "h2d_seconds", py::cast(back->timer()));
  }
  g.fetched = end;
  add(engine, n.h2d_bytes, std::min(end, g.nbytes));
  add(engine, n.groups_fetched, 1);
}

// backward.py's `make_ready`.
void GroupCycle::make_ready(py::handle engine, py::handle group, ActivationGroup& g) {
  const CycleNames& n = cycle_names();
  if (g.fetched < g.nbytes_aligned) fetch(engine, group, g);
  const c10::optional<c10::Stream> stream = current_stream();
  if (g.ready_on(stream)) return;
  TORCH_CHECK(!g.h2d.empty(), "offload: a group is read in backward before its copy back was issued");
  if (!on_accel_) {
    const auto t0 = std::chrono::steady_clock::now();
    synchronize(*g.h2d.back());
    add(engine, n.backward_wait_seconds,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  } else {
    const py::object start = timed_start(engine);
    for (const std::shared_ptr<Transfer>& back : g.h2d) {
      if (g.fetch_stream == stream) {
        // The block's owner waits for the copy: the core need not hold the block until the
        // host sees the copy done (else it would hold the step's last fetched group until
        // the next step's first copy).
        back->release_sources(stream);
      } else {
        back->wait_stream(stream);
      }
    }
    timed_end(engine, "backward_wait_seconds", start);
  }
  g.mark_ready(stream);
}

// backward.py's `prefetch`: without a plan, the group before `group` and, if that is the last
// part of a layer copied in parts, its earlier parts, the last first.
void GroupCycle::prefetch(py::handle engine, py::handle group) {
  const CycleNames& n = cycle_names();
  if (!get(engine, n.schedule).is_none()) return;  // fetched at the points the plan chose
  py::object ref = get(group, n.prev);
  while (true) {
    const py::object before = deref(ref);
    if (before.is_none()) return;
    ActivationGroup& b = before.cast<ActivationGroup&>();
    const bool on_host_only = b.state == kHost && b.fetched < b.nbytes_aligned && b.d2h != nullptr;
    if (on_host_only) {
      fetch(engine, before, b);
      if (b.fetched == b.nbytes_aligned) add(engine, n.groups_prefetched, 1);
    }
    if (!get(before, n.continued).cast<bool>()) return;
    ref = get(before, n.prev);
  }
}

// backward.py's `release`.
void GroupCycle::release(py::handle engine, py::handle group, ActivationGroup& g) {
  const CycleNames& n = cycle_names();
  if (g.state == kOpen) return;
  if (g.holds_device_tensors) {
    const std::shared_ptr<Transfer> d2h = g.d2h;
    if (d2h != nullptr && !query(*d2h) && on_accel_ && g.has_spans) {
      // Served from the device, its copy not seen done: the copy stream protects the sources'
      // memory until it has passed the copy, and the copy engine lets go of them now (Note
      // [served groups' sources] in engine.py). Never a wait for the copy.
      read_copy_streams(engine);
      g.let_sources_go(*d2h_stream_);
      d2h->release_sources(d2h_stream_);
    }
    mark_copied(g);
  }
  g.reset_restore();
}

py::object GroupCycle::next_group(py::handle engine, const py::object& group, ActivationGroup* g,
                                  const py::object& name, bool offload, const py::object& layer, bool* joined) {
  const CycleNames& n = cycle_names();
  *joined = false;
  const int64_t capturing = get(engine, n.capturing).cast<int64_t>();
  const py::object schedule = get(engine, n.schedule);
  if (!name.is_none() && offload && !layer.is_none() && g != nullptr && !g->layer.is_none() && g->state == kOpen &&
      capturing > 0 && schedule.is_none() && g->capped < get(engine, n.min_group_bytes).cast<int64_t>()) {
    // A small layer's group goes on through this layer (fewer, larger copies).
    g->n_layers += 1;
    py::list refs;
    refs.append(get(engine, n.last_offloaded));
    if (PyDict_SetItem(get(engine, n.layer_groups).ptr(), layer.ptr(), refs.ptr()) < 0) throw py::error_already_set();
    *joined = true;
    return group;
  }
  if (name.is_none() || capturing == 0 || !offload) return py::none();
  const py::object last = get(engine, n.last_offloaded);
  const bool first = last.is_none();
  py::object next = py::cast(new ActivationGroup(name, layer, true, last), py::return_value_policy::take_ownership);
  ActivationGroup& made = next.cast<ActivationGroup&>();
  const py::object ref = py::reinterpret_steal<py::object>(PyWeakref_NewRef(next.ptr(), nullptr));
  if (!ref) throw py::error_already_set();
  if (PyObject_SetAttr(engine.ptr(), n.last_offloaded, ref.ptr()) < 0) throw py::error_already_set();
  if (!layer.is_none()) {
    py::list refs;
    refs.append(ref);
    if (PyDict_SetItem(get(engine, n.layer_groups).ptr(), layer.ptr(), refs.ptr()) < 0) throw py::error_already_set();
    if (!schedule.is_none()) {
      // The plan's cap on the bytes of new spans the layer offloads, and its parts.
      const py::object caps = get(schedule, n.caps);
      if (layer.cast<int64_t>() < static_cast<int64_t>(py::len(caps))) {
        made.auto_state = auto_state_class()();
        if (PyObject_SetAttr(made.auto_state.ptr(), n.cap, caps[layer].ptr()) < 0) throw py::error_already_set();
        made.split = dict_get(get(schedule, n.split_at), layer);
      }
    } else if (first && first_layer_parts_) {
      // engine.py's `_first_layer_parts`: the first offloaded layer of the forward, in parts of
      // the bytes it saved last time, where it saved enough spans and bytes for them.
      PyObject* size = PyDict_GetItemWithError(get(engine, n.layer_sizes).ptr(), layer.ptr());  // borrowed
      if (size == nullptr && PyErr_Occurred()) throw py::error_already_set();
      if (size != nullptr) {
        const auto bytes_and_count = py::reinterpret_borrow<py::tuple>(size);
        const auto bytes = bytes_and_count[0].cast<int64_t>();
        const auto count = bytes_and_count[1].cast<int64_t>();
        if (count >= kSplitParts && bytes >= kSplitParts * get(engine, n.min_group_bytes).cast<int64_t>()) {
          py::list ends;
          for (int64_t k = 1; k < kSplitParts; ++k) ends.append(bytes * k / kSplitParts);
          made.split = ends;
        }
      }
    }
  }
  return next;
}

void GroupCycle::close_left(py::handle engine, const py::object& group, ActivationGroup* g, const py::object& name,
                            const py::object& layer) {
  const CycleNames& n = cycle_names();
  if (g != nullptr) close(engine, group, *g);
  const py::object schedule = get(engine, n.schedule);
  if (schedule.is_none() || layer.is_none()) return;
  // The point: layer `layer` opens (n: the last layer ended). Most points release nothing: the
  // engine's `_release_due` is called only where a group's point has come.
  const py::object due = get(engine, n.due);
  for (const py::handle entry : due) {
    const int le = PyObject_RichCompareBool(PyTuple_GET_ITEM(entry.ptr(), 0), layer.ptr(), Py_LE);
    if (le < 0) throw py::error_already_set();
    if (le == 1) {
      get(engine, n.release_due)(layer);
      break;
    }
  }
  if (name.is_none() && !get(schedule, n.tail_save).is_none()) {
    if (PyObject_SetAttr(engine.ptr(), n.tail, py::int_(0).ptr()) < 0) throw py::error_already_set();
  }
}

void GroupCycle::follow_hooks(py::handle engine, bool group_open) {
  const CycleNames& n = cycle_names();
  if (!get(engine, n.hooks_in_groups_only).cast<bool>() || get(engine, n.capturing).cast<int64_t>() != 1) return;
  const bool want = group_open || !get(engine, n.tail).is_none();
  if (want == get(engine, n.hooks_on).cast<bool>()) return;
  get(engine, n.hooks_follow_groups)();
}

void GroupCycle::mark_copied(ActivationGroup& g) {
  g.drop_held();
  g.drop_spans();
  g.state = kHost;
}

// engine.py's `_close`, the plain configuration's branches: no observer, no verify, no
// nvtx range, no listeners, mode async, no plan (the window keeps the groups).
void GroupCycle::close(py::handle engine, py::handle group, ActivationGroup& g) {
  const CycleNames& n = cycle_names();
  const py::object layer = get(group, n.layer);
  if (!layer.is_none() && g.state == kOpen) {  // its last part's sizes: the layer's
    const py::object sizes = get(engine, n.layer_sizes);
    if (PyDict_SetItem(sizes.ptr(), layer.ptr(), py::make_tuple(g.capped, g.new_spans).ptr()) < 0) {
      throw py::error_already_set();
    }
  }
  const int64_t spans = g.seal();
  if (g.state == kKept) {
    g.drop_spans();
    return;
  }
  if (spans == 0) {
    mark_copied(g);
    return;
  }
  read_copy_streams(engine);
  std::shared_ptr<Transfer> out;
  try {
    out = g.copy_out(*pool_, d2h_stream_, chunk_bytes_, timing_);
  } catch (const c10::OutOfMemoryError& e) {
    // The pool is at its limit (Note [pool full] in engine.py): the engine keeps the group
    // on the device and says so once. Nothing was queued for it.
    static PyObject* oom = PyObject_GetAttrString(py::module_::import("torch").ptr(), "OutOfMemoryError");
    const py::object error = py::reinterpret_borrow<py::object>(oom)(e.what_without_backtrace());
    get(engine, n.keep_on_device)(group, error);
    return;
  }
  g.d2h = out;
  if (timing_) {
    const py::object counters = get(engine, n.counters);
    get(get(engine, n.timings), n.copy)(counters, "d2h_seconds", py::cast(out->timer()));
  }
  g.state = kCopying;
  add(engine, n.d2h_bytes, out->nbytes());
  add(engine, n.groups_offloaded, 1);
  add(engine, n.layers_offloaded, get(group, n.n_layers).cast<int64_t>());
  add(engine, n.tensors_offloaded, g.n_handles);
  const py::object ref = py::reinterpret_steal<py::object>(PyWeakref_NewRef(group.ptr(), nullptr));
  if (!ref) throw py::error_already_set();
  if (PyObject_CallMethodOneArg(get(engine, n.inflight).ptr(), py::str("append").ptr(), ref.ptr()) == nullptr) {
    throw py::error_already_set();
  }
  poll(engine);
  g.stream = current_stream();
  const py::object schedule = get(engine, n.schedule);
  if (!schedule.is_none()) {
    // Auto mode: the plan says at which point the copy is complete (Note [planned release
    // points] in auto/schedule.py); no window.
    py::object at = dict_get(get(schedule, n.release_at), get(group, n.layer));
    if (PyList_Check(at.ptr())) {  // a point per part
      const Py_ssize_t parts = PyList_GET_SIZE(at.ptr());
      at = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(at.ptr(), std::min<Py_ssize_t>(g.part, parts - 1)));
    }
    if (!at.is_none() && PyList_Append(get(engine, n.due).ptr(), py::make_tuple(at, ref).ptr()) < 0) {
      throw py::error_already_set();
    }
    return;
  }
  keep_window(engine, g.stream);
}

// engine.py's `_poll`: mark copied, oldest first, the groups whose copies are complete.
void GroupCycle::poll(py::handle engine) {
  const CycleNames& n = cycle_names();
  const py::object inflight = get(engine, n.inflight);
  while (PyObject_Length(inflight.ptr()) > 0) {
    const py::object first = py::reinterpret_steal<py::object>(PySequence_GetItem(inflight.ptr(), 0));
    if (!first) throw py::error_already_set();
    const py::object group = deref(first);
    ActivationGroup* g = group.is_none() ? nullptr : &group.cast<ActivationGroup&>();
    if (g != nullptr && g->state == kCopying && !query(*g->d2h)) return;
    if (!py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(inflight.ptr(), n.popleft))) {
      throw py::error_already_set();
    }
    if (g != nullptr && g->state == kCopying) mark_copied(*g);
  }
}

// engine.py's `_keep_window` (Note [resident window]): the group now opening plus those
// still copying may not exceed `resident_groups`.
void GroupCycle::keep_window(py::handle engine, const c10::optional<c10::Stream>& stream) {
  const CycleNames& n = cycle_names();
  const py::object inflight = get(engine, n.inflight);
  const int64_t resident = get(engine, n.resident_groups).cast<int64_t>();
  while (PyObject_Length(inflight.ptr()) > resident - 1) {
    const py::object oldest_ref =
        py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(inflight.ptr(), n.popleft));
    if (!oldest_ref) throw py::error_already_set();
    const py::object oldest = deref(oldest_ref);
    if (oldest.is_none()) continue;
    ActivationGroup& o = oldest.cast<ActivationGroup&>();
    if (o.state != kCopying) continue;
    const std::shared_ptr<Transfer>& d2h = o.d2h;
    if (stream.has_value() && o.stream == stream) {
      // The compute stream waits on the device, not the host, and the oldest group's tensors,
      // saved on this stream, go back to the allocator in its order.
      const py::object start = timed_start(engine);
      d2h->release_sources(stream);
      timed_end(engine, "forward_wait_seconds", start);
    } else {  // saved on another stream than the one running now: only the host can order it
      const auto t0 = std::chrono::steady_clock::now();
      synchronize(*d2h);
      add(engine, n.forward_wait_seconds,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    mark_copied(o);
  }
}

}  // namespace activation
}  // namespace offload
