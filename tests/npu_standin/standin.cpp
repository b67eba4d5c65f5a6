// A stand-in accelerator for tests: PyTorch's PrivateUse1 device (renamed "npu"
// by tests/npu_standin/__init__.py), so offload's device-generic path runs in CI
// as it would on an Ascend NPU, through the same c10 interfaces torch_npu fills.
//
// What it is:
// - memory: host memory from the CPU allocator, handed out by an allocator
//   registered for PrivateUse1 that counts the bytes it holds (allocated, peak), so
//   peak-memory assertions measure something real;
// - streams and events: a DeviceGuardImplInterface with real c10::Stream ids (a
//   default stream, a pool, new streams) and a current stream per thread and
//   device. Work runs synchronously on the calling thread, so an event is complete
//   when it is recorded, and waiting on one returns at once; elapsed times are
//   host clock differences between records;
// - ops: factories, views, resize/set, copies and scalars have kernels here; every
//   other op runs on the CPU through torch's boxed CPU fallback, which copies the
//   arguments to the CPU, runs the CPU kernel and copies results back.
//
// What it is not: there is no pinned host memory (pin_memory() raises) and no DMA
// engine, so nothing overlaps; tests that need either skip.
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/extension.h>
#include <torch/library.h>

namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
constexpr c10::DeviceIndex kDevices = 1;

// ---------------------------------------------------------------- memory

struct MemoryStats {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
};

MemoryStats& stats(c10::DeviceIndex index) {
  static MemoryStats table[kDevices];
  return table[index < 0 ? 0 : index];
}

// The size travels with the pointer (the deleter's context), so a free updates the count.
struct Block {
  void* data;
  size_t nbytes;
  c10::DeviceIndex device;
};

thread_local c10::DeviceIndex current_device = 0;

void free_block(void* context) {
  auto* block = static_cast<Block*>(context);
  stats(block->device).allocated -= static_cast<int64_t>(block->nbytes);
  c10::free_cpu(block->data);
  delete block;
}

struct StandinAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::DeviceIndex device = current_device;
    void* data = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    auto* block = new Block{data, nbytes, device};
    MemoryStats& s = stats(device);
    const int64_t now = s.allocated += static_cast<int64_t>(nbytes);
    int64_t peak = s.peak.load();
    while (now > peak && !s.peak.compare_exchange_weak(peak, now)) {
    }
    return {data, block, &free_block, c10::Device(kType, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }  // the context is not the pointer
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

StandinAllocator allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &allocator);

// ---------------------------------------------------------------- streams and events

// Stream ids: 0 is the default stream, 1..kPoolSize the pool, then streams made new.
constexpr c10::StreamId kPoolSize = 8;
std::atomic<c10::StreamId> next_new_stream{kPoolSize + 1};
std::atomic<c10::StreamId> next_pool_stream{0};
thread_local c10::StreamId current_streams[kDevices] = {};

struct StandinEvent {
  std::chrono::steady_clock::time_point recorded_at;
};

// What the device's event calls cost the host on a real accelerator is a driver call
// each: the stand-in counts them, so tests can bound the calls a piece of work makes.
struct EventCalls {
  std::atomic<int64_t> created{0};
  std::atomic<int64_t> recorded{0};
  std::atomic<int64_t> waited{0};  // a stream made to wait on an event (block)
  std::atomic<int64_t> queried{0};
  std::atomic<int64_t> destroyed{0};
};

EventCalls& event_calls() {
  static EventCalls calls;
  return calls;
}

struct StandinGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kType, current_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType, "npu stand-in: not an npu device: ", d);
    TORCH_CHECK(d.index() >= 0 && d.index() < kDevices, "npu stand-in: invalid device index ", d.index(),
                " (", int(kDevices), " device(s))");
    current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_device = d.index(); }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, index_of(d)), current_streams[index_of(d)]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, index_of(d)), 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*high_priority*/ = false) const override {
    const c10::StreamId id = 1 + (next_pool_stream++ % kPoolSize);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, index_of(d)), id);
  }
  c10::Stream getNewStream(c10::Device d, int /*priority*/ = 0) const override {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, index_of(d)), next_new_stream++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    current_streams[index_of(s.device())] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return kDevices; }

  // Work is complete when it is queued, so an event is complete when recorded.
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag /*flag*/) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(), "npu stand-in: event device index ",
                int(device_index), " does not match the stream's ", int(stream.device_index()));
    if (*event == nullptr) {
      *event = new StandinEvent();
      event_calls().created++;
    }
    event_calls().recorded++;
    static_cast<StandinEvent*>(*event)->recorded_at = std::chrono::steady_clock::now();
  }
  void block(void* event, const c10::Stream& /*stream*/) const override {
    if (event != nullptr) event_calls().waited++;
  }
  bool queryEvent(void* event) const override {
    if (event != nullptr) event_calls().queried++;
    return true;
  }
  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    if (event != nullptr) event_calls().destroyed++;
    delete static_cast<StandinEvent*>(event);
  }
  bool queryStream(const c10::Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const c10::Stream& /*stream*/) const override {}
  void synchronizeEvent(void* /*event*/) const override {}
  void synchronizeDevice(const c10::DeviceIndex /*device_index*/) const override {}
  void recordDataPtrOnStream(const c10::DataPtr& /*data_ptr*/, const c10::Stream& /*stream*/) const override {}
  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(start && end, "npu stand-in: both events must be recorded before elapsed_time");
    const auto a = static_cast<StandinEvent*>(start)->recorded_at;
    const auto b = static_cast<StandinEvent*>(end)->recorded_at;
    return std::chrono::duration<double, std::milli>(b - a).count();
  }

 private:
  static c10::DeviceIndex index_of(c10::Device d) { return d.has_index() ? d.index() : current_device; }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, StandinGuardImpl);

// ---------------------------------------------------------------- generator and hooks

struct StandinGenerator : at::CPUGeneratorImpl {
  explicit StandinGenerator(c10::DeviceIndex index) {
    device_ = c10::Device(kType, index);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
};

const at::Generator& default_generator(c10::DeviceIndex index) {
  static std::once_flag once;
  static std::vector<at::Generator> generators;
  std::call_once(once, [] {
    for (c10::DeviceIndex i = 0; i < kDevices; ++i) generators.push_back(at::make_generator<StandinGenerator>(i));
  });
  return generators.at(index < 0 ? current_device : index);
}

struct StandinHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return kDevices; }
  void setCurrentDevice(c10::DeviceIndex device) const override { current_device = device; }
  c10::DeviceIndex getCurrentDevice() const override { return current_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    const c10::DeviceIndex old = current_device;
    current_device = device;
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override { return exchangeDevice(device); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    return default_generator(device_index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    return at::make_generator<StandinGenerator>(device_index < 0 ? current_device : device_index);
  }
  c10::Device getDeviceFromPtr(void* /*data*/) const override { return c10::Device(kType, current_device); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    // storage.resize_(n) (parameter offload frees a device copy this way): the CPU's
    // resize, through the storage's allocator, which is this device's.
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);
  }
  bool isPinnedPtr(const void* /*data*/) const override { return false; }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "the npu stand-in has no pinned host memory");
  }
};

// ---------------------------------------------------------------- kernels

// The CPU tensor over `t`'s memory (the same bytes, sizes and strides); it keeps
// t's storage alive.
at::Tensor as_cpu(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kType) return t;
  c10::Storage storage = t.storage();
  c10::DataPtr alias = c10::InefficientStdFunctionContext::makeDataPtr(
      storage.mutable_data(), [storage](void*) {}, c10::Device(c10::DeviceType::CPU));
  c10::Storage cpu_storage(c10::Storage::use_byte_size_t(), storage.nbytes(), std::move(alias), nullptr, false);
  at::Tensor cpu = at::empty({0}, t.options().device(c10::DeviceType::CPU))
                       .set_(cpu_storage, t.storage_offset(), t.sizes(), t.strides());
  cpu._set_conj(t.is_conj());  // lazy conj/neg views stay lazy: the CPU copy resolves them
  cpu._set_neg(t.is_neg());
  return cpu;
}

at::Tensor empty_memory_format(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> /*layout*/, std::optional<at::Device> device,
                               std::optional<bool> /*pin_memory*/, std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(device.value_or(c10::Device(kType, current_device)));
  return at::detail::empty_generic(size, &allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(at::IntArrayRef size, at::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> /*layout*/, std::optional<at::Device> device,
                         std::optional<bool> /*pin_memory*/) {
  c10::DeviceGuard guard(device.value_or(c10::Device(kType, current_device)));
  return at::detail::empty_strided_generic(size, stride, &allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  TORCH_CHECK(self.is_cpu() || self.device().type() == kType, "npu stand-in: cannot copy from ", self.device());
  TORCH_CHECK(dst.is_cpu() || dst.device().type() == kType, "npu stand-in: cannot copy to ", dst.device());
  as_cpu(dst).copy_(as_cpu(self));
  return dst;
}

// copy_ itself, so that conj/neg views are resolved by the CPU copy: _copy_from is
// not transparent to those bits, and resolving them on this device is a copy_ again.
at::Tensor& copy_(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  copy_from(src, self, non_blocking);
  return self;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) { return at::_local_scalar_dense(as_cpu(self)); }

void record_stream(at::Tensor& /*self*/, at::Stream /*stream*/) {
  // Memory is freed at once and work is synchronous: no later use on another stream can race the free.
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &empty_memory_format);
  m.impl("empty_strided", &empty_strided);
  m.impl("as_strided", &at::native::as_strided_tensorimpl);
  m.impl("view", &at::native::view);
  m.impl("_reshape_alias", &at::native::_reshape_alias);
  m.impl("unfold", &at::native::unfold);
  m.impl("view_as_real", &at::native::view_as_real);
  m.impl("view_as_complex", &at::native::view_as_complex);
  m.impl("resize_", &at::native::resize_);
  m.impl("set_.source_Storage", &at::native::set_);
  m.impl("set_.source_Storage_storage_offset", &at::native::set_storage_cpu_);
  m.impl("set_.source_Tensor", &at::native::set_tensor_);
  m.impl("set_", &at::native::set_cpu_);
  m.impl("copy_", &copy_);
  m.impl("_copy_from", &copy_from);
  m.impl("_copy_from_and_resize", &copy_from_and_resize);
  m.impl("_local_scalar_dense", &local_scalar_dense);
  m.impl("record_stream", &record_stream);
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) { at::native::cpu_fallback(op, stack); }

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>()); }

StandinHooks* hooks() {
  static StandinHooks* instance = new StandinHooks();
  return instance;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "offload's test-only npu stand-in (PrivateUse1 over host memory)";
  m.def("register_hooks", [] { at::RegisterPrivateUse1HooksInterface(hooks()); });
  m.def("device_count", [] { return static_cast<int>(kDevices); });
  m.def("current_device", [] { return static_cast<int>(current_device); });
  m.def("set_device", [](int index) {
    TORCH_CHECK_VALUE(index >= 0 && index < kDevices, "npu stand-in: invalid device index ", index);
    current_device = static_cast<c10::DeviceIndex>(index);
  });
  m.def("event_calls", [] {
    const EventCalls& c = event_calls();
    return std::map<std::string, int64_t>{{"created", c.created.load()}, {"recorded", c.recorded.load()},
                                          {"waited", c.waited.load()}, {"queried", c.queried.load()},
                                          {"destroyed", c.destroyed.load()}};
  });
  m.def("memory_allocated", [](int index) { return stats(index).allocated.load(); });
  m.def("max_memory_allocated", [](int index) { return stats(index).peak.load(); });
  m.def("reset_peak_memory_stats", [](int index) { stats(index).peak.store(stats(index).allocated.load()); });
  m.def("get_rng_state", [](int index) {
    at::Generator gen = default_generator(index);
    std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.get_state();
  });
  m.def("set_rng_state", [](const at::Tensor& state, int index) {
    at::Generator gen = default_generator(index);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  });
  m.def("manual_seed", [](uint64_t seed, int index) {
    at::Generator gen = default_generator(index);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  });
  m.def("initial_seed", [](int index) { return default_generator(index).current_seed(); });
}
