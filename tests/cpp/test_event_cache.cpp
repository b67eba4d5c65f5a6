// offload's event cache (csrc/include/offload/event_cache.h) on the scripted
// device of scripted_device.h, whose events complete only when the test says so.
// The cache must hand out again only events that have completed, keep events of
// one device away from another, stay bounded, and order streams.
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include "check.h"
#include "scripted_device.h"
#include "offload/event_cache.h"

namespace {

using scripted::device;
using scripted::driver_event;
using scripted::log;
using scripted::ScriptedEvent;
using scripted::stream;

// Each case uses its own device index: the cache is one per process.
OFFLOAD_TEST(event_cache_reuses_only_completed_events) {
  c10::Event first = offload::take_event(device(0));
  REQUIRE(!first.was_marked_for_recording());  // fresh: the backend creates it at its first record
  ScriptedEvent* id = driver_event(first, 0);
  offload::give_back_event(std::move(first));
  const int created = log().created;
  c10::Event second = offload::take_event(device(0));  // the first is still pending: not handed out
  ScriptedEvent* other = driver_event(second, 0);
  REQUIRE(other != id);
  REQUIRE_EQ(log().created, created + 1);
  offload::give_back_event(std::move(second));
  log().complete_all();
  c10::Event third = offload::take_event(device(0));  // both completed now: a recycled one, nothing created
  REQUIRE(third.was_marked_for_recording());
  ScriptedEvent* again = driver_event(third, 0);
  REQUIRE(again == id || again == other);
  REQUIRE_EQ(log().created, created + 1);
  offload::give_back_event(std::move(third));
}

OFFLOAD_TEST(event_cache_keeps_devices_apart) {
  c10::Event on_one = offload::take_event(device(1));
  ScriptedEvent* id = driver_event(on_one, 1);
  offload::give_back_event(std::move(on_one));
  log().complete_all();
  c10::Event on_two = offload::take_event(device(2));  // device 1's event must not come back here
  REQUIRE(!on_two.was_marked_for_recording());
  ScriptedEvent* other = driver_event(on_two, 2);
  REQUIRE(other != id);
  REQUIRE_EQ(static_cast<int>(on_two.device_index()), 2);
  c10::Event back_on_one = offload::take_event(device(1));
  REQUIRE(driver_event(back_on_one, 1) == id);
}

OFFLOAD_TEST(event_cache_keeps_timing_events_apart) {
  // A completed plain event is at hand, but a timing event (elapsed times need one made
  // with timing) is another: made anew, and handed out again only as a timing event.
  c10::Event plain = offload::take_event(device(2));
  ScriptedEvent* plain_id = driver_event(plain, 2);
  offload::give_back_event(std::move(plain));
  log().complete_all();
  c10::Event timing = offload::take_event(device(2), c10::EventFlag::BACKEND_DEFAULT);
  REQUIRE(!timing.was_marked_for_recording());
  ScriptedEvent* timing_id = driver_event(timing, 2);
  REQUIRE(timing_id != plain_id && timing_id->flag == c10::EventFlag::BACKEND_DEFAULT);
  offload::give_back_event(std::move(timing));
  log().complete_all();
  c10::Event plain_again = offload::take_event(device(2));
  REQUIRE(driver_event(plain_again, 2) == plain_id);
  c10::Event timing_again = offload::take_event(device(2), c10::EventFlag::BACKEND_DEFAULT);
  REQUIRE(driver_event(timing_again, 2) == timing_id);
}

OFFLOAD_TEST(event_cache_queries_only_when_no_completed_event_is_at_hand) {
  // A query is a driver call: a take that finds a completed event of its kind at hand makes
  // none; one that finds none queries the given-back events, oldest first, until one is pending.
  for (int i = 0; i < 3; ++i) {
    c10::Event e = offload::take_event(device(1));
    e.record(stream(1, 1));
    offload::give_back_event(std::move(e));
  }
  log().complete_all();
  c10::Event first = offload::take_event(device(1));  // none at hand: the completed ones are moved
  const int queries = log().queries;
  c10::Event second = offload::take_event(device(1));
  c10::Event third = offload::take_event(device(1));
  REQUIRE(second.was_marked_for_recording() && third.was_marked_for_recording());  // recycled
  REQUIRE_EQ(log().queries, queries);
  second.record(stream(1, 1));  // pending now
  offload::give_back_event(std::move(second));
  c10::Event fourth = offload::take_event(device(1));  // none at hand: one query finds the oldest pending
  REQUIRE(!fourth.was_marked_for_recording());
  REQUIRE_EQ(log().queries, queries + 1);
}

OFFLOAD_TEST(event_cache_never_given_back_twice_and_drops_unrecorded) {
  c10::Event unused = offload::take_event(device(3));
  const int destroyed = log().destroyed;
  offload::give_back_event(std::move(unused));  // no driver event behind it: nothing kept, nothing destroyed
  REQUIRE_EQ(log().destroyed, destroyed);
  c10::Event e = offload::take_event(device(3));
  REQUIRE(!e.was_marked_for_recording());
}

OFFLOAD_TEST(event_cache_stays_bounded) {
  // More pending events than the cache keeps: the oldest are destroyed, not held without bound.
  const int destroyed = log().destroyed;
  for (int i = 0; i < 1100; ++i) {
    c10::Event e = offload::take_event(device(3));
    e.record(stream(3, 1));
    offload::give_back_event(std::move(e));
  }
  REQUIRE(log().destroyed - destroyed >= 1100 - 1024 - 8);  // a few queried complete may be reused instead
  REQUIRE(static_cast<int>(log().live.size()) <= 1024 + 256 + 16);
}

OFFLOAD_TEST(order_after_makes_the_waiter_wait_for_the_producer) {
  log().blocks.clear();
  offload::order_after(stream(0, 7), stream(0, 5));
  REQUIRE_EQ(log().blocks.size(), size_t(1));
  REQUIRE_EQ(log().blocks[0].first->recorded_on, c10::StreamId(5));
  REQUIRE_EQ(log().blocks[0].second, c10::StreamId(7));
  offload::order_after(stream(0, 7), stream(0, 7));  // one stream is in order already: no event
  REQUIRE_EQ(log().blocks.size(), size_t(1));
}

}  // namespace

int main(int argc, char** argv) { return offload_test::run_all(argc, argv); }
