// The few AscendCL declarations offload's NPU sources use, for compiling them
// where CANN is not installed (CI's compile check, tests/test_npu_build.py).
// Declarations only: nothing here links or runs. Each one is spelled as CANN's
// own acl/acl_base.h and acl/acl_rt.h spell it, so the same sources compile
// against a real CANN (setup.py puts $ASCEND_TOOLKIT_HOME/include first there and
// never adds this folder). A source that calls anything missing here fails the
// compile check: add its declaration, copied from CANN's headers, with the use.
//
// OFFLOAD_ACL_STUB_WITHOUT_HOST_REG_PINNED leaves out what older CANN lacks
// (aclrtHostRegisterV2 and its ACL_HOST_REG_* flags, documented from CANN 8.5), so the check also compiles
// the path taken against an older CANN.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ACL_FUNC_VISIBILITY __attribute__((visibility("default")))

// acl/acl_base.h
typedef int aclError;
static const int ACL_SUCCESS = 0;

ACL_FUNC_VISIBILITY const char *aclGetRecentErrMsg();

// acl/acl_rt.h
#ifndef OFFLOAD_ACL_STUB_WITHOUT_HOST_REG_PINNED
#define ACL_HOST_REG_MAPPED 0x2UL
#define ACL_HOST_REG_PINNED 0X10000000UL

ACL_FUNC_VISIBILITY aclError aclrtHostRegisterV2(void *ptr, uint64_t size, uint32_t flag);
#endif

ACL_FUNC_VISIBILITY aclError aclrtHostUnregister(void *ptr);

#ifdef __cplusplus
}
#endif
