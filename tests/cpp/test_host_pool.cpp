// offload::HostPool through its C++ API (csrc/include/offload/host_pool.h), on the
// CPU: size classes, reuse, the limit and its error, reserve/trim, threads; and,
// with the scripted device of scripted_device.h, that a block is not handed out
// again before the copies recorded on it have completed.
#include <atomic>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "check.h"
#include "scripted_device.h"
#include "offload/host_pool.h"

namespace {

constexpr size_t KiB = size_t(1) << 10;
constexpr size_t MiB = size_t(1) << 20;
constexpr size_t GiB = size_t(1) << 30;

std::shared_ptr<offload::HostPool> make_pool(size_t limit_bytes = 0, size_t slab_bytes = 2 * MiB) {
  return offload::HostPool::create(c10::DeviceType::CPU, limit_bytes, slab_bytes, /*touch_threads=*/2);
}

const void* address(const at::Tensor& t) { return t.storage().data(); }

// Host memory for copies on the scripted device: plain memory (no pinner), events from the script.
std::shared_ptr<offload::HostPool> make_scripted_pool() {
  return offload::HostPool::create(c10::DeviceType::PrivateUse1, /*limit_bytes=*/0, 2 * MiB, /*touch_threads=*/1);
}

}  // namespace

OFFLOAD_TEST(size_class_small_requests_round_to_powers_of_two) {
  using offload::HostPool;
  REQUIRE_EQ(HostPool::size_class(0), size_t(512));
  REQUIRE_EQ(HostPool::size_class(1), size_t(512));
  REQUIRE_EQ(HostPool::size_class(512), size_t(512));
  REQUIRE_EQ(HostPool::size_class(513), size_t(1024));
  REQUIRE_EQ(HostPool::size_class(1000), size_t(1024));
  REQUIRE_EQ(HostPool::size_class(64 * KiB + 1), size_t(128 * KiB));
  REQUIRE_EQ(HostPool::size_class(MiB), MiB);
  for (size_t n = 1; n <= MiB; n = n * 3 + 1) {
    const size_t cls = HostPool::size_class(n);
    REQUIRE(cls >= n && cls < 2 * n + 512);
    REQUIRE_EQ(cls & (cls - 1), size_t(0));  // a power of two
  }
}

OFFLOAD_TEST(size_class_large_requests_round_to_2mib_only) {
  using offload::HostPool;
  REQUIRE_EQ(HostPool::size_class(MiB + 1), 2 * MiB);
  REQUIRE_EQ(HostPool::size_class(3 * MiB), 4 * MiB);
  // PyTorch's pinned cache turns 1.25 GiB into 2 GiB; the pool keeps it at 1.25 GiB.
  REQUIRE_EQ(HostPool::size_class(GiB + GiB / 4), GiB + GiB / 4);
  REQUIRE_EQ(HostPool::size_class(GiB + 1), GiB + 2 * MiB);
  for (size_t n = MiB + 1; n < 64 * MiB; n = n * 5 / 3 + 12345) {
    const size_t cls = HostPool::size_class(n);
    REQUIRE(cls >= n && cls - n < 2 * MiB);
    REQUIRE_EQ(cls % (2 * MiB), size_t(0));
  }
}

OFFLOAD_TEST(allocate_returns_a_writable_uint8_host_tensor) {
  auto pool = make_pool();
  at::Tensor t = pool->allocate(1000);
  REQUIRE_EQ(t.scalar_type(), at::kByte);
  REQUIRE(t.device().is_cpu());
  REQUIRE_EQ(t.numel(), int64_t(1000));
  REQUIRE(!pool->pinned());  // no pinner on a CPU pool
  REQUIRE(pool->owns(t));
  REQUIRE(pool->owns(t.narrow(0, 10, 20)));
  REQUIRE(!pool->owns(at::empty({1000}, at::kByte)));
  // On the CPU, record_stream has nothing to wait for and only says whether it owns the tensor.
  REQUIRE(pool->record_stream(t, c10::Stream(c10::Stream::DEFAULT, c10::Device(at::kCPU))));
  t.fill_(7);
  REQUIRE_EQ(t.sum().item<int64_t>(), int64_t(7000));
  const auto s = pool->stats();
  REQUIRE_EQ(s.in_use_bytes, size_t(1024));
  REQUIRE_EQ(s.reserved_bytes, 2 * MiB);
  REQUIRE_EQ(s.requests, uint64_t(1));
  REQUIRE_EQ(s.slabs, uint64_t(1));
}

OFFLOAD_TEST(released_block_is_reused_by_the_same_class) {
  auto pool = make_pool();
  const void* first = nullptr;
  {
    at::Tensor t = pool->allocate(1000);
    first = address(t);
  }
  REQUIRE_EQ(pool->stats().in_use_bytes, size_t(0));
  REQUIRE_EQ(pool->stats().free_bytes, size_t(1024));
  at::Tensor again = pool->allocate(700);  // also the 1 KiB class
  REQUIRE_EQ(address(again), first);
  at::Tensor other = pool->allocate(3000);  // a different class: another block
  REQUIRE(address(other) != first);
  const auto s = pool->stats();
  REQUIRE_EQ(s.requests, uint64_t(3));
  REQUIRE_EQ(s.cache_hits, uint64_t(1));
  REQUIRE_EQ(s.in_use_bytes, size_t(1024 + 4096));
  REQUIRE_EQ(s.peak_in_use_bytes, size_t(1024 + 4096));
}

OFFLOAD_TEST(block_stays_in_use_while_a_view_lives) {
  auto pool = make_pool();
  at::Tensor t = pool->allocate(1000);
  const void* first = address(t);
  at::Tensor view = t.narrow(0, 100, 10);
  t.reset();
  REQUIRE_EQ(pool->stats().in_use_bytes, size_t(1024));
  at::Tensor next = pool->allocate(1000);
  REQUIRE(address(next) != first);  // the live view's block is not handed out twice
  view.reset();
  at::Tensor third = pool->allocate(1000);
  REQUIRE_EQ(address(third), first);
}

OFFLOAD_TEST(exceeding_the_limit_raises_an_error_naming_the_knob) {
  auto pool = make_pool(/*limit_bytes=*/4 * MiB, /*slab_bytes=*/2 * MiB);
  REQUIRE_EQ(pool->limit(), 4 * MiB);
  at::Tensor a = pool->allocate(2 * MiB);
  at::Tensor b = pool->allocate(2 * MiB);
  REQUIRE_EQ(pool->stats().reserved_bytes, 4 * MiB);
  REQUIRE_THROWS(pool->allocate(1), c10::Error, "OFFLOAD_HOST_POOL_LIMIT");
  REQUIRE_THROWS(pool->allocate(1), c10::OutOfMemoryError, "4 MiB are in use");
  REQUIRE_THROWS(pool->reserve(MiB), c10::Error, "OFFLOAD_HOST_POOL_LIMIT");
  // A wholly free slab is given back to make room under the limit.
  a.reset();
  at::Tensor c = pool->allocate(1);
  REQUIRE(c.defined());
  REQUIRE(pool->stats().reserved_bytes <= 4 * MiB);
  // Raising the limit lets the pool grow.
  pool->set_limit(0);
  at::Tensor d = pool->allocate(3 * MiB);
  REQUIRE_EQ(pool->stats().reserved_bytes, 2 * MiB + 2 * MiB + 4 * MiB);
}

OFFLOAD_TEST(reserve_and_trim_account_for_every_byte) {
  auto pool = make_pool(/*limit_bytes=*/0, /*slab_bytes=*/2 * MiB);
  pool->reserve(5 * MiB);
  auto s = pool->stats();
  REQUIRE_EQ(s.reserved_bytes, 6 * MiB);  // rounded to whole huge pages
  REQUIRE_EQ(s.slabs, uint64_t(1));
  REQUIRE_EQ(s.in_use_bytes, size_t(0));
  pool->reserve(MiB);  // already room: no growth
  REQUIRE_EQ(pool->stats().reserved_bytes, 6 * MiB);
  {
    at::Tensor t = pool->allocate(MiB);
    at::Tensor u = pool->allocate(3 * MiB);
    s = pool->stats();
    REQUIRE_EQ(s.reserved_bytes, 6 * MiB);  // carved from the reserved slab
    REQUIRE_EQ(s.in_use_bytes, 5 * MiB);
    REQUIRE_EQ(pool->trim(), size_t(0));  // its blocks are in use
    REQUIRE_EQ(pool->stats().reserved_bytes, 6 * MiB);
  }
  s = pool->stats();
  REQUIRE_EQ(s.in_use_bytes, size_t(0));
  REQUIRE_EQ(s.free_bytes, 5 * MiB);
  REQUIRE_EQ(s.peak_in_use_bytes, 5 * MiB);
  REQUIRE_EQ(pool->trim(), 6 * MiB);
  s = pool->stats();
  REQUIRE_EQ(s.reserved_bytes, size_t(0));
  REQUIRE_EQ(s.free_bytes, size_t(0));
  REQUIRE_EQ(s.slabs, uint64_t(0));
  at::Tensor after = pool->allocate(100);  // grows again after a trim
  REQUIRE_EQ(pool->stats().reserved_bytes, 2 * MiB);
}

OFFLOAD_TEST(a_wholly_free_slab_is_cut_afresh_before_the_pool_grows) {
  auto pool = make_pool(/*limit_bytes=*/0, /*slab_bytes=*/8 * MiB);
  {
    std::vector<at::Tensor> large;
    for (int i = 0; i < 4; ++i) large.push_back(pool->allocate(2 * MiB));  // the whole first slab
  }
  REQUIRE_EQ(pool->stats().free_bytes, 8 * MiB);  // cached as four 2 MiB blocks
  at::Tensor small = pool->allocate(256 * KiB);   // no 256 KiB block cached, no tail left: reuse the slab
  auto s = pool->stats();
  REQUIRE_EQ(s.slabs, uint64_t(1));
  REQUIRE_EQ(s.reserved_bytes, 8 * MiB);
  REQUIRE_EQ(s.recycled_slabs, uint64_t(1));
  REQUIRE_EQ(s.free_bytes, size_t(0));  // its 2 MiB blocks are gone from the free lists
  at::Tensor mid = pool->allocate(4 * MiB);  // carved from the same slab, after `small`
  REQUIRE_EQ(pool->stats().slabs, uint64_t(1));
  REQUIRE(static_cast<const char*>(address(mid)) >= static_cast<const char*>(address(small)) + 256 * KiB);
  at::Tensor more = pool->allocate(4 * MiB);  // the slab has live blocks: the pool grows
  s = pool->stats();
  REQUIRE_EQ(s.slabs, uint64_t(2));
  REQUIRE_EQ(s.recycled_slabs, uint64_t(1));
  std::memset(small.data_ptr(), 1, 256 * KiB);  // the three blocks do not overlap
  std::memset(mid.data_ptr(), 2, 4 * MiB);
  std::memset(more.data_ptr(), 3, 4 * MiB);
  REQUIRE_EQ(static_cast<const uint8_t*>(small.data_ptr())[256 * KiB - 1], uint8_t(1));
  REQUIRE_EQ(static_cast<const uint8_t*>(mid.data_ptr())[4 * MiB - 1], uint8_t(2));
}

OFFLOAD_TEST(eight_threads_never_share_a_block) {
  auto pool = make_pool(/*limit_bytes=*/0, /*slab_bytes=*/4 * MiB);
  constexpr int kThreads = 8;
  constexpr int kIterations = 300;
  const size_t sizes[] = {100, 700, 3000, 20000, 70000};
  std::atomic<int> corrupted{0};
  std::atomic<int> errors{0};
  auto work = [&](int id) {
    try {
      std::deque<std::pair<at::Tensor, uint8_t>> held;
      for (int i = 0; i < kIterations; ++i) {
        at::Tensor t = pool->allocate(sizes[(id + i) % 5]);
        const auto pattern = static_cast<uint8_t>(id * 31 + i);
        std::memset(t.data_ptr(), pattern, t.numel());
        held.emplace_back(std::move(t), pattern);
        if (held.size() > 4 || i % 7 == 0) {
          // Another thread writing into this block would have changed its bytes.
          const auto& [old, expected] = held.front();
          const auto* bytes = static_cast<const uint8_t*>(old.data_ptr());
          for (int64_t k = 0; k < old.numel(); ++k) {
            if (bytes[k] != expected) {
              corrupted += 1;
              break;
            }
          }
          held.pop_front();
        }
        if (i % 50 == 0) (void)pool->stats();
      }
    } catch (...) {
      errors += 1;
    }
  };
  std::vector<std::thread> threads;
  for (int id = 0; id < kThreads; ++id) threads.emplace_back(work, id);
  for (auto& t : threads) t.join();
  REQUIRE_EQ(errors.load(), 0);
  REQUIRE_EQ(corrupted.load(), 0);
  const auto s = pool->stats();
  REQUIRE_EQ(s.in_use_bytes, size_t(0));
  REQUIRE_EQ(s.requests, uint64_t(kThreads * kIterations));
  REQUIRE(s.cache_hits > 0);
  REQUIRE(s.peak_in_use_bytes <= s.reserved_bytes);
  REQUIRE_EQ(pool->trim(), s.reserved_bytes);  // every block came back
}

int main(int argc, char** argv) { return offload_test::run_all(argc, argv); }

OFFLOAD_TEST(block_is_not_reused_before_the_copies_recorded_on_it_complete) {
  auto pool = make_scripted_pool();
  at::Tensor a = pool->allocate(4096);
  const void* where = address(a);
  const int created = scripted::log().created;
  REQUIRE(pool->record_stream(a, scripted::stream(0, 1)));  // a copy on stream 1 reads it
  REQUIRE(pool->record_stream(a, scripted::stream(0, 1)));  // later work on the same stream: the same event
  REQUIRE(pool->record_stream(a, scripted::stream(0, 2)));  // and one on stream 2
  REQUIRE_EQ(scripted::log().created, created + 2);
  a.reset();  // the tensor dies while its copies are still queued
  REQUIRE_EQ(pool->stats().pending_blocks, size_t(1));
  at::Tensor b = pool->allocate(4096);  // the same class: must not get the block still being read
  REQUIRE(address(b) != where);
  b.reset();
  const size_t free_before = pool->stats().free_bytes;  // b's block only: a's copies still run
  scripted::log().complete_all();
  // stats() itself sees that the copies are done (a reserve sized from free_bytes relies on it).
  REQUIRE_EQ(pool->stats().pending_blocks, size_t(0));
  REQUIRE_EQ(pool->stats().free_bytes, free_before + offload::HostPool::size_class(4096));
  at::Tensor c = pool->allocate(4096);  // both copies done: the block is free again
  at::Tensor d = pool->allocate(4096);
  REQUIRE(address(c) == where || address(d) == where);
  REQUIRE_EQ(pool->stats().pending_blocks, size_t(0));
}

OFFLOAD_TEST(a_block_recorded_with_a_copys_completion_event_shares_it) {
  // The copy engine hands the pool the event it recorded after a copy (RecordedEvent): the
  // pool records none of its own, and still holds the block back until that event completes.
  auto pool = make_scripted_pool();
  at::Tensor a = pool->allocate(4096);
  const void* where = address(a);
  offload::SharedEvent done = offload::record_event(scripted::stream(0, 1));
  const int created = scripted::log().created;
  REQUIRE(pool->record_stream(a, scripted::stream(0, 1), done));
  REQUIRE(pool->record_stream(a, scripted::stream(0, 1), done));  // the same stream: replaced, not added
  REQUIRE_EQ(scripted::log().created, created);
  REQUIRE_EQ(done.use_count(), long(2));  // the caller's and the pool's one entry
  a.reset();
  REQUIRE_EQ(pool->stats().pending_blocks, size_t(1));
  at::Tensor b = pool->allocate(4096);
  REQUIRE(address(b) != where);
  b.reset();
  scripted::log().complete_all();
  REQUIRE_EQ(pool->stats().pending_blocks, size_t(0));
  done.reset();
}

// A block used by copies on streams `one` and `two` stays held back until both complete.
static void check_block_waits_for_both(const c10::Stream& one, const c10::Stream& two) {
  auto pool = make_scripted_pool();
  at::Tensor a = pool->allocate(8192);
  const void* where = address(a);
  REQUIRE(pool->record_stream(a, one));
  REQUIRE(pool->record_stream(a, two));
  a.reset();
  REQUIRE(scripted::log().complete_one(one.id()));  // one of the copies completes: the block stays held back
  std::vector<at::Tensor> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(pool->allocate(8192));
    REQUIRE(address(held.back()) != where);
  }
  scripted::log().complete_all();
  at::Tensor again = pool->allocate(8192);
  REQUIRE(address(again) == where);
}

OFFLOAD_TEST(block_waits_for_every_stream_that_used_it) {
  check_block_waits_for_both(scripted::stream(1, 3), scripted::stream(1, 4));
}

OFFLOAD_TEST(block_used_by_streams_of_two_devices_waits_for_both) {
  // Stream ids are unique per device only: the same id on two devices is two streams.
  check_block_waits_for_both(scripted::stream(0, 5), scripted::stream(1, 5));
}

OFFLOAD_TEST(pool_destroyed_with_a_pending_block_waits_for_its_copy) {
  // The last tensor dies while a copy still uses its block, and with it the pool: the
  // memory must not go back to the system before the copy is done (a host wait).
  auto pool = make_scripted_pool();
  at::Tensor a = pool->allocate(4096);
  REQUIRE(pool->record_stream(a, scripted::stream(2, 9)));
  const int waits = scripted::log().synchronized;
  pool.reset();  // the tensor still holds the pool
  REQUIRE_EQ(scripted::log().synchronized, waits);
  a.reset();  // the pool goes with it, its block still pending
  REQUIRE(scripted::log().synchronized > waits);
}

OFFLOAD_TEST(a_slab_whose_block_a_copy_still_reads_is_not_recycled) {
  auto pool = make_scripted_pool();  // 2 MiB slabs
  at::Tensor a = pool->allocate(2 * MiB);
  const void* where = address(a);
  REQUIRE(pool->record_stream(a, scripted::stream(0, 1)));
  a.reset();  // pending: its copy still runs
  at::Tensor b = pool->allocate(4096);
  REQUIRE_EQ(pool->stats().slabs, uint64_t(2));
  REQUIRE_EQ(pool->stats().recycled_slabs, uint64_t(0));
  REQUIRE(static_cast<const char*>(address(b)) >= static_cast<const char*>(where) + 2 * MiB ||
          static_cast<const char*>(address(b)) < static_cast<const char*>(where));
  scripted::log().complete_all();
  REQUIRE_EQ(pool->stats().pending_blocks, size_t(0));
}
