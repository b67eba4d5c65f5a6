// offload::copy_to_host / copy_to_device through their C++ API
// (csrc/include/offload/transfer.h) on CPU tensors: the CPU path runs the same
// grouping, packing, chunking and stride bookkeeping as a device would, with
// memcpy in place of DMA. Every round trip is compared bit for bit.
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "check.h"
#include "offload/host_pool.h"
#include "offload/transfer.h"

namespace {

constexpr size_t MiB = size_t(1) << 20;
const c10::Device kCpu(at::kCPU);

std::shared_ptr<offload::HostPool> make_pool() {
  return offload::HostPool::create(c10::DeviceType::CPU, /*limit_bytes=*/0, 4 * MiB, /*touch_threads=*/2);
}

// Default options pack everything here into one block; the small ones send
// most tensors alone, in 256-byte chunks, and pack the rest in several groups.
offload::CopyOptions small_options() {
  offload::CopyOptions o;
  o.small_bytes = 64;
  o.chunk_bytes = 256;
  return o;
}

// Random bits of every dtype (NaN payloads included for floats): compared as bytes.
at::Tensor random_bits(at::IntArrayRef sizes, at::ScalarType dtype) {
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype));
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  if (dtype == at::kBool) return at::randint(0, 2, sizes, at::kLong).to(at::kBool);
  at::Tensor bytes = at::randint(0, 256, {numel * itemsize}, at::kLong).to(at::kByte);
  return bytes.view(dtype).view(sizes);
}

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  return at::equal(a.contiguous().reshape({-1}).view(at::kByte), b.contiguous().reshape({-1}).view(at::kByte));
}

std::string strides_of(const at::Tensor& t) { return offload_test::show(t.strides()); }

// One tensor of each layout the engine treats differently.
std::vector<at::Tensor> layouts() {
  std::vector<at::Tensor> ts;
  ts.push_back(random_bits({1001}, at::kFloat));                                 // contiguous, odd size
  ts.push_back(random_bits({33, 17}, at::kBFloat16).t());                        // transposed: dense
  ts.push_back(random_bits({8, 10}, at::kLong).slice(1, 1, 10, 2));              // sliced: not dense
  ts.push_back(random_bits({1, 5}, at::kHalf).expand({4, 5}));                   // broadcast
  ts.push_back(at::empty({0, 3}, at::kFloat));                                   // empty
  ts.push_back(random_bits({}, at::kDouble));                                    // 0-dim
  ts.push_back(random_bits({7, 3}, at::kBool));
  ts.push_back(random_bits({13}, at::kFloat8_e4m3fn));
  ts.push_back(random_bits({3000}, at::kInt).narrow(0, 5, 2990));                // offset into its storage
  return ts;
}

void check_round_trip(const offload::CopyOptions& options) {
  auto pool = make_pool();
  const std::vector<at::Tensor> sources = layouts();
  std::vector<at::Tensor> originals;
  for (const auto& t : sources) originals.push_back(t.clone());

  auto to_host = offload::copy_to_host(sources, *pool, std::nullopt, std::nullopt, nullptr, options);
  REQUIRE(to_host->query());  // CPU copies are done on return
  const auto& host = to_host->tensors();
  REQUIRE_EQ(host.size(), sources.size());
  int64_t expected_bytes = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    REQUIRE(bitwise_equal(host[i], originals[i]));
    REQUIRE(host[i].device().is_cpu());
    if (host[i].numel() > 0) {
      REQUIRE(host[i].storage().data() != sources[i].storage().data());  // a copy, not an alias
      REQUIRE(pool->owns(host[i]));  // in pooled host memory
    }
    expected_bytes += sources[i].numel() * static_cast<int64_t>(sources[i].element_size());
  }
  REQUIRE_EQ(strides_of(host[1]), strides_of(sources[1]));  // dense: strides kept
  REQUIRE(host[2].is_contiguous());                          // not dense: contiguous on the host
  REQUIRE(to_host->restore_specs()[2].has_value());
  REQUIRE_EQ(host[3].stride(0), int64_t(0));                 // broadcast stays a broadcast view
  // Broadcast tensors move one row, not four.
  REQUIRE_EQ(to_host->nbytes(), expected_bytes - 3 * 5 * 2);

  // The host copies must not depend on the sources (zeroed through their
  // storage: a broadcast view cannot be written in place).
  for (const auto& t : sources) {
    if (t.storage().nbytes() > 0) std::memset(t.storage().mutable_data(), 0, t.storage().nbytes());
  }
  REQUIRE(!bitwise_equal(sources[0], originals[0]));
  for (size_t i = 0; i < sources.size(); ++i) REQUIRE(bitwise_equal(host[i], originals[i]));

  auto to_device = offload::copy_to_device(host, to_host, kCpu, *pool, std::nullopt, std::nullopt, options);
  REQUIRE(to_device->query());
  const auto& back = to_device->tensors();
  REQUIRE_EQ(back.size(), sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    REQUIRE(bitwise_equal(back[i], originals[i]));
    REQUIRE_EQ(strides_of(back[i]), strides_of(sources[i]));  // the original layout, sliced one included
  }
}

}  // namespace

OFFLOAD_TEST(round_trip_packed_is_bitwise_exact) { check_round_trip(offload::CopyOptions()); }

OFFLOAD_TEST(round_trip_chunked_is_bitwise_exact) { check_round_trip(small_options()); }

OFFLOAD_TEST(many_tiny_tensors_pack_into_few_blocks) {
  auto pool = make_pool();
  std::vector<at::Tensor> sources;
  for (int i = 0; i < 300; ++i) sources.push_back(random_bits({1 + i % 37}, at::kFloat));
  auto handle = offload::copy_to_host(sources, *pool, std::nullopt, std::nullopt, nullptr, offload::CopyOptions());
  const auto& host = handle->tensors();
  for (size_t i = 0; i < sources.size(); ++i) REQUIRE(bitwise_equal(host[i], sources[i]));
  // One packed group: all 300 share one pooled block (one DMA on a device).
  REQUIRE_EQ(host.front().storage().data(), host.back().storage().data());
  REQUIRE_EQ(pool->stats().requests, uint64_t(1));

  auto back = offload::copy_to_device(host, nullptr, kCpu, *pool, std::nullopt, std::nullopt, offload::CopyOptions());
  for (size_t i = 0; i < sources.size(); ++i) REQUIRE(bitwise_equal(back->tensors()[i], sources[i]));
}

OFFLOAD_TEST(copy_into_out_and_reuse_a_handle) {
  auto pool = make_pool();
  std::vector<at::Tensor> sources = {random_bits({64, 3}, at::kFloat), random_bits({5}, at::kShort)};
  std::vector<at::Tensor> out = {at::empty({64, 3}, at::kFloat), at::empty({5}, at::kShort)};
  offload::CopyOptions options;
  options.require_pinned = false;  // plain host memory: a CPU pool has no pinned memory anyway
  auto into = offload::copy_to_host(sources, *pool, std::nullopt, out, nullptr, options);
  for (size_t i = 0; i < sources.size(); ++i) {
    REQUIRE_EQ(into->tensors()[i].data_ptr(), out[i].data_ptr());
    REQUIRE(bitwise_equal(out[i], sources[i]));
  }

  auto first = offload::copy_to_host(sources, *pool, std::nullopt, std::nullopt, nullptr, options);
  std::vector<at::Tensor> next = {random_bits({64, 3}, at::kFloat), random_bits({5}, at::kShort)};
  auto second = offload::copy_to_host(next, *pool, std::nullopt, std::nullopt, first, options);
  for (size_t i = 0; i < next.size(); ++i) {
    REQUIRE_EQ(second->tensors()[i].data_ptr(), first->tensors()[i].data_ptr());  // same host buffers
    REQUIRE(bitwise_equal(second->tensors()[i], next[i]));
  }
}

OFFLOAD_TEST(meta_tensor_is_rejected) {
  auto pool = make_pool();
  std::vector<at::Tensor> meta = {at::empty({4}, at::TensorOptions().dtype(at::kFloat).device(at::kMeta))};
  REQUIRE_THROWS(offload::copy_to_host(meta, *pool, std::nullopt, std::nullopt, nullptr, offload::CopyOptions()),
               c10::Error, "offload.copy_to_host: tensors[0] is a meta tensor");
  REQUIRE_THROWS(offload::copy_to_device(meta, nullptr, kCpu, *pool, std::nullopt, std::nullopt, offload::CopyOptions()),
               c10::ValueError, "offload.copy_to_device: tensors[0] is a meta tensor");
  REQUIRE_EQ(pool->stats().requests, uint64_t(0));  // nothing allocated for a rejected call
}

OFFLOAD_TEST(bad_out_is_rejected) {
  auto pool = make_pool();
  std::vector<at::Tensor> sources = {at::ones({4}, at::kFloat)};
  offload::CopyOptions options;
  options.require_pinned = false;
  std::vector<at::Tensor> too_many = {at::empty({4}), at::empty({4})};
  REQUIRE_THROWS(offload::copy_to_host(sources, *pool, std::nullopt, too_many, nullptr, options), c10::ValueError,
               "out has 2 tensors but tensors has 1");
  std::vector<at::Tensor> wrong_dtype = {at::empty({4}, at::kDouble)};
  REQUIRE_THROWS(offload::copy_to_host(sources, *pool, std::nullopt, wrong_dtype, nullptr, options), c10::ValueError,
               "out[0] has shape [4] and dtype float64 but tensors[0] has shape [4] and dtype float32");
  std::vector<at::Tensor> wrong_shape = {at::empty({2, 2})};
  REQUIRE_THROWS(offload::copy_to_device(sources, nullptr, kCpu, *pool, std::nullopt, wrong_shape, options),
               c10::ValueError, "out[0] has shape [2, 2]");
}

// copy_to_host_deferred on host tensors runs at once (no stream order protects a
// snapshot on the host); the checks and the timing are those of a deferred copy.
OFFLOAD_TEST(deferred_copy_on_the_host_is_synchronous_and_checked) {
  auto pool = make_pool();
  std::vector<at::Tensor> sources = {random_bits({64, 3}, at::kFloat), random_bits({5}, at::kShort)};
  auto first = offload::copy_to_host(sources, *pool, std::nullopt, std::nullopt, nullptr, offload::CopyOptions());
  REQUIRE_THROWS(first->copy_seconds(), c10::ValueError, "offload.CopyHandle.copy_seconds: this copy was not timed");
  REQUIRE_THROWS(offload::copy_to_host_deferred(sources, *pool, std::nullopt, nullptr, offload::CopyOptions()),
                 c10::ValueError, "offload.copy_to_host: defer=True needs out=<CopyHandle>");
  std::vector<at::Tensor> stale = {random_bits({64, 3}, at::kFloat), random_bits({6}, at::kShort)};
  REQUIRE_THROWS(offload::copy_to_host_deferred(stale, *pool, std::nullopt, first, offload::CopyOptions()),
                 c10::ValueError, "tensors[1]");

  std::vector<at::Tensor> next = {random_bits({64, 3}, at::kFloat), random_bits({5}, at::kShort)};
  offload::CopyOptions timed;
  timed.timing = true;
  auto second = offload::copy_to_host_deferred(next, *pool, std::nullopt, first, timed);
  REQUIRE(!second->enqueue_pending());
  REQUIRE(second->query());
  for (size_t i = 0; i < next.size(); ++i) {
    REQUIRE_EQ(second->tensors()[i].data_ptr(), first->tensors()[i].data_ptr());
    REQUIRE(bitwise_equal(second->tensors()[i], next[i]));
  }
  const auto seconds = second->copy_seconds();
  REQUIRE(seconds.has_value() && *seconds >= 0.0);
}

// A deferred copy from a lazily converted source converts every tensor before
// it calls `converted` (where Python lets the GIL go), and none after.
OFFLOAD_TEST(deferred_copy_converts_every_source_before_it_says_so) {
  auto pool = make_pool();
  std::vector<at::Tensor> sources;
  for (int i = 0; i < 300; ++i) sources.push_back(random_bits({i % 7 + 1}, at::kFloat));
  auto first = offload::copy_to_host(sources, *pool, std::nullopt, std::nullopt, nullptr, offload::CopyOptions());
  int said = 0, converted_after = 0;
  auto fill = [&](std::vector<at::Tensor>& into, size_t upto) {
    converted_after += said;
    while (into.size() < upto) into.push_back(sources[into.size()]);
  };
  auto lazy = std::make_unique<offload::TensorSource>(sources.size(), fill);
  auto second = offload::copy_to_host_deferred(std::move(lazy), *pool, std::nullopt, first, offload::CopyOptions(),
                                               [&] { said += 1; });
  REQUIRE_EQ(said, 1);
  REQUIRE_EQ(converted_after, 0);
  for (size_t i = 0; i < sources.size(); ++i) REQUIRE(bitwise_equal(second->tensors()[i], sources[i]));
}

int main(int argc, char** argv) { return offload_test::run_all(argc, argv); }
