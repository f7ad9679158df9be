// Stub of CANN's aclnn/aclnn_base.h (the aclnn two-stage interface's common types): see
// acl/acl_base.h for what this tree is.
#pragma once
#include <stdint.h>
#include "acl/acl_base.h"
#include "acl/acl_rt.h"

#ifdef __cplusplus
extern "C" {
#endif
typedef int32_t aclnnStatus;
typedef struct aclOpExecutor aclOpExecutor;
static const aclnnStatus ACLNN_SUCCESS = 0;
#ifdef __cplusplus
}
#endif
