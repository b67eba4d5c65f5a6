// A group's cycle in native code: the layer boundary that closes one group and opens the
// next; its close (the copy out, the poll of the copies in flight, the resident window or
// the plan's release point); in backward its copy back, its reader's wait, the fetch of the
// group before it and its release. These are offload/activation/forward.py's `boundary`,
// `close`, `poll`, `keep_window` and `release_due` and backward.py's `fetch`,
// `fetch_groups`, `make_ready`, `prefetch` and `release` (whose notes give the reasons), for
// the engine's plain configuration: no observer of auto mode (a measured step), no
// listeners, no verify, no nvtx ranges, mode async or auto. A plan of auto mode (its
// schedule) is followed here too: its caps and parts, its release points and its fetch
// points (hooks the engine sets on layer outputs). The table's `boundary`, `close_group`,
// `fetch_group`, `release_due` and `fetch_layers` and the unpack hook (saved_tensor_hooks.cpp)
// call these there instead of the Python methods, so a group's cycle makes no interpreter call
// but the timing's (an accelerator with timing on); elsewhere the Python methods run, which
// serve the observer and the events. The engine says which (`PackTable.native_cycle`).
//
// The state is the group's own (the core's ActivationGroup: its copies and the engine's
// per-layer fields), so either path can take up a group the other left: a step whose
// configuration changes between its forward and its backward (a listener added) finishes
// in Python.
//
// Streams: a group's restored block is allocated on the consumer's (current) stream,
// which owns it (`fetch_stream`); the copy back runs on the engine's host-to-device
// stream after the copy out; the consumer waits for it on the device, or, as the
// block's owner, also lets the copy engine drop it at once (release_sources).
#pragma once

#include <cstdint>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <torch/extension.h>

#include "activation_group.h"
#include "offload/host_pool.h"
#include "step_timings.h"

namespace offload {
namespace activation {

class GroupCycle {
 public:
  GroupCycle(c10::Device device, bool on_accel) : device_(device), on_accel_(on_accel) {}

  // Whether the unpack hook runs a group's backward here (the engine's plain configuration).
  bool native = false;

  // forward.py's `close` (plain configuration): seal the group, issue its copy out, poll the
  // copies in flight and keep the resident window.
  void close(py::handle engine, py::handle group, ActivationGroup& g);

  // forward.py's `boundary` (plain configuration), given the open group (None; `g` its core,
  // null) and the boundary's arguments. Returns the group to open next: the open one where a
  // small layer joins it (`*joined` set), else a new group, or None. Closes the open group
  // otherwise, after the caller has let go of it.
  py::object next_group(py::handle engine, const py::object& group, ActivationGroup* g, const py::object& name,
                        bool offload, const py::object& layer, bool* joined);
  // forward.py's `split` (Note [layer parts] in engine.py): the group to go on in after the
  // layer's open group (`g`, its core) passed a part end of `ends` (the layer's part ends,
  // `g.split` as the pack table holds them); the engine's bookkeeping of the layer's groups
  // follows it. The caller opens it, then closes the group.
  py::object next_part(py::handle engine, ActivationGroup& g, const std::vector<int64_t>& ends);
  // The open group of the plain configuration's boundary was let go of: close it (None: nothing),
  // then, under a schedule, release what is due at layer `layer`'s point and start counting the
  // tensors saved after the last layer.
  void close_left(py::handle engine, const py::object& group, ActivationGroup* g, const py::object& name,
                  const py::object& layer);
  // forward.py's `release_due` (no listeners here): let go of the groups whose planned release
  // point has come (Note [planned release points] in auto/schedule.py), the current stream
  // waiting on the device for each one's copy; the host is never blocked.
  void release_due(py::handle engine, const py::object& point);
  // backward.py's `fetch_groups`: fetch the groups of `refs` (weak references, or None) that
  // are on the host; with `share` (not None), the groups of one layer up to that share of
  // their bytes, in the order given (Note [fetch in pieces] in auto/schedule.py). Fetched
  // here where the cycle is native, else by the engine's Python `_fetch_group`, which serves
  // listeners and nvtx.
  void fetch_groups(py::handle engine, const py::handle& refs, const py::object& share);
  // forward.py's `hooks_follow_groups`, called only where it has something to switch.
  void follow_hooks(py::handle engine, bool group_open);

  // The engine's copy settings, given once: its pool (`pool_owner` holds `pool` alive),
  // the Python class that wraps a transfer (offload.core.copy.CopyHandle, what a group's
  // `d2h` and `h2d_handles` give Python), the copy engine's packing and chunk sizes, and
  // where copies and waits are timed, the engine's timings (a StepTimings; None: untimed).
  void configure(py::object pool_owner, py::object handle_class, int64_t small_bytes, int64_t chunk_bytes,
                 const py::object& timings, bool first_layer_parts);

  // Fetches what is not fetched of `group` (its Python object; `g`, its core) and makes its
  // reader on the current stream (the host, without one) wait for the copy back, once per
  // stream and backward.
  void make_ready(py::handle engine, py::handle group, ActivationGroup& g);
  // backward.py's `fetch`: what is left of the group (`upto` < 0), or its bytes up to `upto`
  // (a piece, Note [fetch in pieces] in auto/schedule.py), where the cycle is native.
  void fetch(py::handle engine, ActivationGroup& g, int64_t upto);
  // `fetch` where the cycle is native, else the engine's Python `_fetch_group`.
  void fetch_any(py::handle engine, py::handle group, ActivationGroup& g, int64_t upto);
  // Backward reached `group`: fetch the group before it, and that group's earlier parts.
  void prefetch(py::handle engine, py::handle group);
  // Every handle of `group` was unpacked: its device copies go (the host copy stays).
  void release(py::handle engine, py::handle group, ActivationGroup& g);

 private:
  void poll(py::handle engine);
  void keep_window(py::handle engine, const c10::optional<c10::Stream>& stream);
  // forward.py's `mark_copied` (no listeners here): the held tensors go, the group is on the host.
  static void mark_copied(ActivationGroup& g);
  c10::optional<c10::Stream> current_stream() const;
  // The engine's (device-to-host, host-to-device) copy streams, read from it once.
  void read_copy_streams(py::handle engine);
  // The engine's wait timing: an event on the current stream before and after a wait (null
  // where untimed), counted to the step's `counters[kind]`.
  std::shared_ptr<WaitStart> timed_start();
  void timed_end(py::handle engine, PyObject* kind, const std::shared_ptr<WaitStart>& start);
  // A copy's time, counted to the step's `counters[kind]` (where timed).
  void timed_copy(py::handle engine, PyObject* kind, const Transfer& copy);

  c10::Device device_;
  bool on_accel_;
  py::object pool_owner_;
  HostPool* pool_ = nullptr;
  int64_t small_bytes_ = 0;
  int64_t chunk_bytes_ = 0;
  std::shared_ptr<StepTimings> timings_;  // null: untimed
  bool first_layer_parts_ = false;  // mode async: the forward's first offloaded layer in parts
  bool streams_read_ = false;
  c10::optional<c10::Stream> d2h_stream_;
  c10::optional<c10::Stream> h2d_stream_;
};

}  // namespace activation
}  // namespace offload
