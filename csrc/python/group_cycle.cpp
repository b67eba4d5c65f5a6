// GroupCycle: a group's cycle in native code (group_cycle.h says when it runs). Each
// method is the twin of the method of offload/activation/forward.py, engine.py or backward.py named
// in its comment; a test holds the two paths equal (gradients, statistics, events of the
// steps around them).
#include "group_cycle.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "engine_interface.h"
#include "offload/transfer.h"

namespace offload {
namespace activation {

namespace {

// forward.py's SPLIT_PARTS: the forward's first offloaded layer in async mode is copied in this
// many parts (Note [layer parts]).
constexpr int64_t kSplitParts = 4;

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

// A weak reference to `group`, made the engine's last offloaded group (`_last_offloaded`),
// which the next group links back to.
py::object link_as_last(py::handle engine, const py::object& group) {
  py::object ref = py::reinterpret_steal<py::object>(PyWeakref_NewRef(group.ptr(), nullptr));
  if (!ref) throw py::error_already_set();
  if (PyObject_SetAttr(engine.ptr(), engine_names().last_offloaded, ref.ptr()) < 0) throw py::error_already_set();
  return ref;
}

}  // namespace

void GroupCycle::configure(py::object pool_owner, py::object handle_class, int64_t small_bytes, int64_t chunk_bytes,
                           const py::object& timings, bool first_layer_parts) {
  first_layer_parts_ = first_layer_parts;
  pool_ = &pool_owner.cast<HostPool&>();
  pool_owner_ = std::move(pool_owner);
  set_copy_handle_class(std::move(handle_class));
  small_bytes_ = small_bytes;
  chunk_bytes_ = chunk_bytes;
  timings_ = timings.is_none() ? nullptr : timings.cast<std::shared_ptr<StepTimings>>();
}

c10::optional<c10::Stream> GroupCycle::current_stream() const {
  if (!on_accel_) return c10::nullopt;
  return c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_);
}

void GroupCycle::read_copy_streams(py::handle engine) {
  if (streams_read_) return;
  // engine.py's `_copy_streams`
  const py::tuple streams = attr(engine, engine_names().copy_streams)().cast<py::tuple>();
  d2h_stream_ = streams[0].cast<c10::optional<c10::Stream>>();
  h2d_stream_ = streams[1].cast<c10::optional<c10::Stream>>();
  streams_read_ = true;
}

std::shared_ptr<WaitStart> GroupCycle::timed_start() {
  if (timings_ == nullptr) return nullptr;
  return timings_->start(*current_stream());
}

void GroupCycle::timed_end(py::handle engine, PyObject* kind, const std::shared_ptr<WaitStart>& start) {
  if (start == nullptr) return;
  timings_->end(attr(engine, engine_names().counters), py::reinterpret_borrow<py::object>(kind), start,
                *current_stream());
}

void GroupCycle::timed_copy(py::handle engine, PyObject* kind, const Transfer& copy) {
  if (timings_ == nullptr) return;
  timings_->copy(attr(engine, engine_names().counters), py::reinterpret_borrow<py::object>(kind), copy.timer());
}

// Where the cycle is native, `fetch` below; else the engine's Python fetch, which serves
// listeners, nvtx ranges and the observer.
void GroupCycle::fetch_any(py::handle engine, py::handle group, ActivationGroup& g, int64_t upto) {
  if (native) {
    fetch(engine, g, upto);
  } else {
    attr(engine, engine_names().fetch_in_python)(group, upto < 0 ? py::none() : py::object(py::int_(upto)));
  }
}

// backward.py's `fetch`: the group's host block copied back into a device block laid out as
// it, all that is left of it (`upto` < 0) or its bytes up to `upto` (a piece of a plan's,
// Note [fetch in pieces] in auto/schedule.py).
void GroupCycle::fetch(py::handle engine, ActivationGroup& g, int64_t upto) {
  const EngineNames& n = engine_names();
  const int64_t end = upto < 0 ? g.nbytes_aligned : std::min(g.nbytes_aligned, span_aligned(upto));
  const int64_t start = g.fetched;
  if (end <= start) return;
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
  options.timing = timings_ != nullptr;
  const bool whole = start == 0 && end == g.nbytes_aligned;
  if (!whole && start == 0) {
    // The first piece: the copy stream waits for the copy out (a group let go at a release
    // point was seen complete on the device only); the pieces after it queue behind it on
    // the same stream, so they wait too.
    if (on_accel_) {
      source->wait_stream(h2d_stream_);
    } else {
      synchronize(*source);
    }
  }
  const c10::optional<std::vector<at::Tensor>> out{
      std::vector<at::Tensor>{whole ? g.device_block : g.device_block.slice(0, start, end)}};
  const std::vector<at::Tensor> piece =
      whole ? std::vector<at::Tensor>{} : std::vector<at::Tensor>{source->tensors().at(0).slice(0, start, end)};
  release_finished_copies();  // what earlier copies left, dropped with the interpreter lock held
  std::shared_ptr<Transfer> back;
  {
    py::gil_scoped_release no_gil;
    // A whole group from the copy out's transfer: the copy stream also waits for that copy,
    // and times after both waits. A piece from its slice of the host block.
    back = whole ? copy_to_device(source->tensors(), source, device_, *pool_, h2d_stream_, out, options)
                 : copy_to_device(piece, nullptr, device_, *pool_, h2d_stream_, out, options);
  }
  // Pieces queue on one copy stream in order: the last one done means all are.
  g.h2d.push_back(back);
  timed_copy(engine, n.h2d_seconds, *back);
  g.fetched = end;
  // Counted in the group's bytes, not its block's padding.
  add_count(engine, n.h2d_bytes, std::min(end, g.nbytes) - std::min(start, g.nbytes));
  if (end == g.nbytes_aligned) add_count(engine, n.groups_fetched, 1);
}

// backward.py's `make_ready`.
void GroupCycle::make_ready(py::handle engine, py::handle group, ActivationGroup& g) {
  const EngineNames& n = engine_names();
  if (g.fetched < g.nbytes_aligned) fetch_any(engine, group, g, -1);
  const c10::optional<c10::Stream> stream = current_stream();
  if (g.ready_on(stream)) return;
  TORCH_CHECK(!g.h2d.empty(), "offload: a group is read in backward before its copy back was issued");
  if (!on_accel_) {
    const auto t0 = std::chrono::steady_clock::now();
    synchronize(*g.h2d.back());
    add_count(engine, n.backward_wait_seconds,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  } else {
    const std::shared_ptr<WaitStart> start = timed_start();
    for (const std::shared_ptr<Transfer>& back : g.h2d) {
      if (g.owns_block(stream)) {
        // The block's owner waits for the copy: the core need not hold the block until the
        // host sees the copy done (else it would hold the step's last fetched group until
        // the next step's first copy).
        back->release_sources(stream);
      } else {
        back->wait_stream(stream);
      }
    }
    timed_end(engine, n.backward_wait_seconds, start);
  }
  g.mark_ready(stream);
}

// backward.py's `prefetch`: without a plan, the group before `group` and, if that is the last
// part of a layer copied in parts, its earlier parts, the last first.
void GroupCycle::prefetch(py::handle engine, py::handle group) {
  const EngineNames& n = engine_names();
  if (!attr(engine, n.schedule).is_none()) return;  // fetched at the points the plan chose
  py::object ref = group.cast<ActivationGroup&>().prev;
  while (true) {
    const py::object before = deref(ref);
    if (before.is_none()) return;
    ActivationGroup& b = before.cast<ActivationGroup&>();
    if (b.on_host_only()) {
      fetch_any(engine, before, b, -1);
      if (b.fetched == b.nbytes_aligned) add_count(engine, n.groups_prefetched, 1);
    }
    if (!b.continued) return;
    ref = b.prev;
  }
}

// backward.py's `release`.
void GroupCycle::release(py::handle engine, py::handle group, ActivationGroup& g) {
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
  const EngineNames& n = engine_names();
  *joined = false;
  const int64_t capturing = attr(engine, n.capturing).cast<int64_t>();
  const py::object schedule = attr(engine, n.schedule);
  if (!name.is_none() && offload && !layer.is_none() && g != nullptr && !g->layer.is_none() && g->state == kOpen &&
      capturing > 0 && schedule.is_none() && g->capped < attr(engine, n.min_group_bytes).cast<int64_t>()) {
    // A small layer's group goes on through this layer (fewer, larger copies).
    g->n_layers += 1;
    py::list refs;
    refs.append(attr(engine, n.last_offloaded));
    if (PyDict_SetItem(attr(engine, n.layer_groups).ptr(), layer.ptr(), refs.ptr()) < 0) throw py::error_already_set();
    *joined = true;
    return group;
  }
  if (name.is_none() || capturing == 0 || !offload) return py::none();
  const py::object last = attr(engine, n.last_offloaded);
  const bool first = last.is_none();
  py::object next = py::cast(new ActivationGroup(name, layer, true, last), py::return_value_policy::take_ownership);
  ActivationGroup& made = next.cast<ActivationGroup&>();
  const py::object ref = link_as_last(engine, next);
  if (!layer.is_none()) {
    py::list refs;
    refs.append(ref);
    if (PyDict_SetItem(attr(engine, n.layer_groups).ptr(), layer.ptr(), refs.ptr()) < 0) throw py::error_already_set();
    if (!schedule.is_none()) {
      // The plan's cap on the bytes of new spans the layer offloads, and its parts.
      const py::object caps = attr(schedule, n.caps);
      if (layer.cast<int64_t>() < static_cast<int64_t>(py::len(caps))) {
        made.auto_state = auto_state_class()();
        if (PyObject_SetAttr(made.auto_state.ptr(), n.cap, caps[layer].ptr()) < 0) throw py::error_already_set();
        made.split = dict_get(attr(schedule, n.split_at), layer);
      }
    } else if (first && first_layer_parts_) {
      // forward.py's `first_layer_parts`: the first offloaded layer of the forward, in parts of
      // the bytes it saved last time, where it saved enough spans and bytes for them.
      PyObject* size = PyDict_GetItemWithError(attr(engine, n.layer_sizes).ptr(), layer.ptr());  // borrowed
      if (size == nullptr && PyErr_Occurred()) throw py::error_already_set();
      if (size != nullptr) {
        const auto bytes_and_count = py::reinterpret_borrow<py::tuple>(size);
        const auto bytes = bytes_and_count[0].cast<int64_t>();
        const auto count = bytes_and_count[1].cast<int64_t>();
        if (count >= kSplitParts && bytes >= kSplitParts * attr(engine, n.min_group_bytes).cast<int64_t>()) {
          py::list ends;
          for (int64_t k = 1; k < kSplitParts; ++k) ends.append(bytes * k / kSplitParts);
          made.split = ends;
        }
      }
    }
  }
  return next;
}

py::object GroupCycle::next_part(py::handle engine, ActivationGroup& g, const std::vector<int64_t>& ends) {
  const EngineNames& n = engine_names();
  py::object next = py::cast(new ActivationGroup(g.name, g.layer, true, attr(engine, n.last_offloaded)),
                             py::return_value_policy::take_ownership);
  ActivationGroup& part = next.cast<ActivationGroup&>();
  part.capped = g.capped;
  part.split = g.split;
  part.continued = true;
  if (!g.auto_state.is_none()) {  // the layer's cap goes on; the measurements are the first part's
    part.auto_state = auto_state_class()();
    if (PyObject_SetAttr(part.auto_state.ptr(), n.cap, attr(g.auto_state, n.cap).ptr()) < 0) {
      throw py::error_already_set();
    }
  }
  part.new_spans = g.new_spans;
  part.n_layers = 0;
  // One span may pass several part ends: this group ends the last of them (its copy is
  // planned complete by that part's point, not an earlier one).
  auto index = static_cast<size_t>(g.part);
  while (index < ends.size() && g.capped >= ends[index]) ++index;
  g.part = static_cast<int64_t>(index) - 1;
  part.part = static_cast<int64_t>(index);
  const py::object ref = link_as_last(engine, next);
  const py::object refs = dict_get(attr(engine, n.layer_groups), g.layer);
  if (!PyList_Check(refs.ptr()) || PyList_Append(refs.ptr(), ref.ptr()) < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "offload: a layer in parts has no list of its groups");
    throw py::error_already_set();
  }
  return next;
}

void GroupCycle::close_left(py::handle engine, const py::object& group, ActivationGroup* g, const py::object& name,
                            const py::object& layer) {
  const EngineNames& n = engine_names();
  if (g != nullptr) close(engine, group, *g);
  const py::object schedule = attr(engine, n.schedule);
  if (schedule.is_none() || layer.is_none()) return;
  release_due(engine, layer);  // the point: layer `layer` opens (n: the last layer ended)
  if (name.is_none() && !attr(schedule, n.tail_save).is_none()) {
    if (PyObject_SetAttr(engine.ptr(), n.tail, py::int_(0).ptr()) < 0) throw py::error_already_set();
  }
}

void GroupCycle::release_due(py::handle engine, const py::object& point) {
  const EngineNames& n = engine_names();
  const py::object due = attr(engine, n.due);
  const double here = point.cast<double>();
  bool any = false;  // most points release nothing: no stream read, no list made
  for (const py::handle entry : due) {
    if (PyFloat_AsDouble(PyTuple_GET_ITEM(entry.ptr(), 0)) <= here) {
      any = true;
      break;
    }
  }
  if (PyErr_Occurred()) throw py::error_already_set();
  if (!any) return;
  const c10::optional<c10::Stream> stream = current_stream();
  const double layers = attr(attr(engine, n.schedule), n.layer_count).cast<double>();
  PyObject* kind = here < layers + 1 ? n.forward_wait_seconds : n.backward_wait_seconds;
  py::list pending;
  for (const py::handle entry : due) {
    const py::object group = deref(py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(entry.ptr(), 1)));
    if (group.is_none()) continue;
    ActivationGroup& g = group.cast<ActivationGroup&>();
    if (g.state != kCopying) continue;
    if (PyFloat_AsDouble(PyTuple_GET_ITEM(entry.ptr(), 0)) > here) {
      pending.append(entry);
    } else if (g.saved_on(stream)) {
      const std::shared_ptr<WaitStart> start = timed_start();
      g.d2h->release_sources(stream);
      timed_end(engine, kind, start);
      mark_copied(g);
    } else if (query(*g.d2h)) {  // saved on another stream: left to the poll until its copy is seen done
      mark_copied(g);
    }
  }
  if (PyObject_SetAttr(engine.ptr(), n.due, pending.ptr()) < 0) throw py::error_already_set();
}

void GroupCycle::fetch_groups(py::handle engine, const py::handle& refs, const py::object& share) {
  const EngineNames& n = engine_names();
  std::vector<py::object> groups;
  int64_t total = 0;
  for (const py::handle ref : refs) {
    py::object group = ref.is_none() ? py::none() : deref(py::reinterpret_borrow<py::object>(ref));
    if (group.is_none()) continue;
    total += group.cast<ActivationGroup&>().nbytes_aligned;
    groups.push_back(std::move(group));
  }
  const bool whole = share.is_none();
  double wanted = whole ? 0.0 : share.cast<double>() * static_cast<double>(total);
  for (const py::object& group : groups) {
    ActivationGroup& g = group.cast<ActivationGroup&>();
    const double size = static_cast<double>(g.nbytes_aligned);
    // upto: None (all of it) where no share is asked or the share left covers the group.
    const bool all = whole || wanted >= size;
    const int64_t upto = all ? 0 : static_cast<int64_t>(wanted);
    if (!whole) wanted = std::max(0.0, wanted - size);
    if (!g.on_host_only() || (!all && upto == 0)) continue;
    fetch_any(engine, group, g, all ? -1 : upto);
    if (g.fetched == g.nbytes_aligned) add_count(engine, n.groups_prefetched, 1);
  }
}

void GroupCycle::follow_hooks(py::handle engine, bool group_open) {
  const EngineNames& n = engine_names();
  if (!attr(engine, n.hooks_in_groups_only).cast<bool>() || attr(engine, n.capturing).cast<int64_t>() != 1) return;
  const bool want = group_open || !attr(engine, n.tail).is_none();
  if (want == attr(engine, n.hooks_on).cast<bool>()) return;
  attr(engine, n.hooks_follow_groups)();
}

void GroupCycle::mark_copied(ActivationGroup& g) {
  g.drop_held();
  g.drop_spans();
  g.state = kHost;
}

// forward.py's `close`, the plain configuration's branches: no observer, no verify, no
// nvtx range, no listeners, mode async or auto (the window keeps the groups, or the plan's
// release points).
void GroupCycle::close(py::handle engine, py::handle group, ActivationGroup& g) {
  const EngineNames& n = engine_names();
  if (!g.layer.is_none() && g.state == kOpen) {  // its last part's sizes: the layer's
    const py::object sizes = attr(engine, n.layer_sizes);
    if (PyDict_SetItem(sizes.ptr(), g.layer.ptr(), py::make_tuple(g.capped, g.new_spans).ptr()) < 0) {
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
    out = g.copy_out(*pool_, d2h_stream_, chunk_bytes_, timings_ != nullptr);
  } catch (const c10::OutOfMemoryError& e) {
    // The pool is at its limit (Note [pool full] in engine.py): the engine keeps the group
    // on the device and says so once. Nothing was queued for it.
    static PyObject* oom = PyObject_GetAttrString(py::module_::import("torch").ptr(), "OutOfMemoryError");
    const py::object error = py::reinterpret_borrow<py::object>(oom)(e.what_without_backtrace());
    attr(engine, n.keep_on_device)(group, error);
    return;
  }
  g.d2h = out;
  timed_copy(engine, n.d2h_seconds, *out);
  g.state = kCopying;
  add_count(engine, n.d2h_bytes, out->nbytes());
  add_count(engine, n.groups_offloaded, 1);
  add_count(engine, n.layers_offloaded, g.n_layers);
  add_count(engine, n.tensors_offloaded, g.n_handles);
  const py::object ref = py::reinterpret_steal<py::object>(PyWeakref_NewRef(group.ptr(), nullptr));
  if (!ref) throw py::error_already_set();
  if (PyObject_CallMethodOneArg(attr(engine, n.inflight).ptr(), n.append, ref.ptr()) == nullptr) {
    throw py::error_already_set();
  }
  poll(engine);
  g.stream = current_stream();
  const py::object schedule = attr(engine, n.schedule);
  if (!schedule.is_none()) {
    // Auto mode: the plan says at which point the copy is complete (Note [planned release
    // points] in auto/schedule.py); no window.
    py::object at = dict_get(attr(schedule, n.release_at), g.layer);
    if (PyList_Check(at.ptr())) {  // a point per part
      const Py_ssize_t parts = PyList_GET_SIZE(at.ptr());
      at = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(at.ptr(), std::min<Py_ssize_t>(g.part, parts - 1)));
    }
    if (!at.is_none() && PyList_Append(attr(engine, n.due).ptr(), py::make_tuple(at, ref).ptr()) < 0) {
      throw py::error_already_set();
    }
    return;
  }
  keep_window(engine, g.stream);
}

// forward.py's `poll`: mark copied, oldest first, the groups whose copies are complete.
void GroupCycle::poll(py::handle engine) {
  const EngineNames& n = engine_names();
  const py::object inflight = attr(engine, n.inflight);
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

// forward.py's `keep_window` (Note [resident window]): the group now opening plus those
// still copying may not exceed `resident_groups`.
void GroupCycle::keep_window(py::handle engine, const c10::optional<c10::Stream>& stream) {
  const EngineNames& n = engine_names();
  const py::object inflight = attr(engine, n.inflight);
  const int64_t resident = attr(engine, n.resident_groups).cast<int64_t>();
  while (PyObject_Length(inflight.ptr()) > resident - 1) {
    const py::object oldest_ref =
        py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(inflight.ptr(), n.popleft));
    if (!oldest_ref) throw py::error_already_set();
    const py::object oldest = deref(oldest_ref);
    if (oldest.is_none()) continue;
    ActivationGroup& o = oldest.cast<ActivationGroup&>();
    if (o.state != kCopying) continue;
    const std::shared_ptr<Transfer>& d2h = o.d2h;
    if (o.saved_on(stream)) {
      // The compute stream waits on the device, not the host, and the oldest group's tensors,
      // saved on this stream, go back to the allocator in its order.
      const std::shared_ptr<WaitStart> start = timed_start();
      d2h->release_sources(stream);
      timed_end(engine, n.forward_wait_seconds, start);
    } else {  // saved on another stream than the one running now: only the host can order it
      const auto t0 = std::chrono::steady_clock::now();
      synchronize(*d2h);
      add_count(engine, n.forward_wait_seconds,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    mark_copied(o);
  }
}

}  // namespace activation
}  // namespace offload
