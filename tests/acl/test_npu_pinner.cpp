// The Ascend pinner (csrc/core/npu/host_memory_npu.cpp) against a scripted ACL:
// the three ACL functions it calls are defined here, recording their arguments
// and returning what a case sets. Built and run by tests/test_npu_build.py with
// the stub headers of csrc/stubs; no CANN and no NPU are needed.
//
// The pinner probes ACL once per process (usable()), so a case that needs the
// probe to fail runs in a process of its own: the first argument names the case.
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <acl/acl.h>

#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

#include "check.h"
#include "offload/host_memory.h"

namespace {

struct ScriptedAcl {
  aclError register_result = ACL_SUCCESS;
  const char* message = "";
  std::vector<std::tuple<void*, uint64_t, uint32_t>> registered;
  std::vector<void*> unregistered;
} acl;

constexpr size_t MiB = size_t(1) << 20;

// Collects c10 warnings (TORCH_WARN) while alive.
struct Warnings : c10::WarningHandler {
  std::vector<std::string> seen;
  void process(const c10::Warning& warning) override { seen.push_back(warning.msg()); }
};

}  // namespace

extern "C" {
aclError aclrtHostRegisterV2(void* ptr, uint64_t size, uint32_t flag) {
  acl.registered.emplace_back(ptr, size, flag);
  return acl.register_result;
}
aclError aclrtHostUnregister(void* ptr) {
  acl.unregistered.push_back(ptr);
  return ACL_SUCCESS;
}
const char* aclGetRecentErrMsg() { return acl.message; }
}

OFFLOAD_TEST(npu_pinner_is_registered_for_privateuse1) {
  REQUIRE(offload::host_memory_pinner_registered(c10::DeviceType::PrivateUse1));
  REQUIRE(!offload::host_memory_pinner_registered(c10::DeviceType::CUDA));
  REQUIRE(!offload::host_memory_pinner_registered(c10::DeviceType::CPU));
}

OFFLOAD_TEST(npu_pinner_pins_in_place_and_unpins) {
  offload::HostMemoryPinner* pinner = offload::host_memory_pinner(c10::DeviceType::PrivateUse1);
  REQUIRE(pinner != nullptr);
  // The probe registered one slab and undid it.
  REQUIRE_EQ(acl.registered.size(), size_t(1));
  REQUIRE_EQ(acl.unregistered.size(), size_t(1));
  REQUIRE(std::get<0>(acl.registered[0]) == acl.unregistered[0]);
  REQUIRE_EQ(std::get<2>(acl.registered[0]), uint32_t(ACL_HOST_REG_PINNED));

  void* slab = offload::allocate_touched(4 * MiB, 2);
  pinner->pin(slab, 4 * MiB);
  REQUIRE_EQ(acl.registered.size(), size_t(2));
  REQUIRE(std::get<0>(acl.registered[1]) == slab);
  REQUIRE_EQ(std::get<1>(acl.registered[1]), uint64_t(4 * MiB));
  REQUIRE_EQ(std::get<2>(acl.registered[1]), uint32_t(ACL_HOST_REG_PINNED));
  pinner->unpin(slab);
  REQUIRE_EQ(acl.unregistered.size(), size_t(2));
  REQUIRE(acl.unregistered[1] == slab);
  offload::free_touched(slab);
  // Asked again, the pinner does not probe again.
  REQUIRE(offload::host_memory_pinner(c10::DeviceType::PrivateUse1) == pinner);
  REQUIRE_EQ(acl.registered.size(), size_t(2));
}

OFFLOAD_TEST(npu_pinner_failure_is_out_of_memory_naming_call_size_error_and_knobs) {
  offload::HostMemoryPinner* pinner = offload::host_memory_pinner(c10::DeviceType::PrivateUse1);
  REQUIRE(pinner != nullptr);
  acl.register_result = 207001;
  acl.message = "EL0004: Failed to allocate memory.";
  void* slab = offload::allocate_touched(6 * MiB, 1);
  for (const char* text : {"offload.HostPool: aclrtHostRegisterV2 of 6 MiB failed", "ACL error 207001",
                           "EL0004: Failed to allocate memory.", "ulimit -l", "OFFLOAD_HOST_POOL_LIMIT",
                           "slab_bytes"}) {
    REQUIRE_THROWS(pinner->pin(slab, 6 * MiB), c10::OutOfMemoryError, text);
  }
  offload::free_touched(slab);
  acl.register_result = ACL_SUCCESS;
  acl.message = "";
}

// Run alone: the first probe of the process fails.
OFFLOAD_TEST(npu_pinner_refused_by_the_device_is_not_used) {
  acl.register_result = 207000;  // ACL_ERROR_RT_FEATURE_NOT_SUPPORT
  acl.message = "EE1001: feature not supported";
  Warnings warnings;
  c10::WarningUtils::WarningHandlerGuard guard(&warnings);
  REQUIRE(offload::host_memory_pinner(c10::DeviceType::PrivateUse1) == nullptr);
  REQUIRE(offload::host_memory_pinner_registered(c10::DeviceType::PrivateUse1));
  REQUIRE_EQ(acl.registered.size(), size_t(1));
  REQUIRE(acl.unregistered.empty());  // nothing was registered, so nothing to undo
  REQUIRE_EQ(warnings.seen.size(), size_t(1));
  REQUIRE(warnings.seen[0].find("ACL error 207000: EE1001: feature not supported") != std::string::npos);
  REQUIRE(warnings.seen[0].find("torch_npu's pinned allocator") != std::string::npos);
  // Decided once: later pools do not ask ACL again, nor warn again.
  REQUIRE(offload::host_memory_pinner(c10::DeviceType::PrivateUse1) == nullptr);
  REQUIRE_EQ(acl.registered.size(), size_t(1));
  REQUIRE_EQ(warnings.seen.size(), size_t(1));
}

int main(int argc, char** argv) { return offload_test::run_all(argc, argv); }
