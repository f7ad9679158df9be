// Stub of CANN's acl/acl_op.h (single-operator execution types): see acl_base.h.
#pragma once
#include "acl/acl_base.h"
#include "acl/acl_rt.h"

#ifdef __cplusplus
extern "C" {
#endif
typedef enum aclEngineType { ACL_ENGINE_SYS = 0, ACL_ENGINE_AICORE = 1, ACL_ENGINE_VECTOR = 2 } aclEngineType;
typedef enum aclCompileType { ACL_COMPILE_SYS = 0, ACL_COMPILE_UNREGISTERED = 1 } aclopCompileType;
typedef enum aclCompileOpt { ACL_PRECISION_MODE = 0, ACL_AICORE_NUM = 1, ACL_OP_JIT_COMPILE = 15 } aclCompileOpt;
aclopAttr *aclopCreateAttr();
void aclopDestroyAttr(const aclopAttr *attr);
#ifdef __cplusplus
}
#endif
