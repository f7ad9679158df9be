// Stub of CANN's acl/acl.h: see acl_base.h for what this tree is.
#pragma once
#include "acl/acl_base.h"
#include "acl/acl_rt.h"
#include "acl/acl_op.h"

#ifdef __cplusplus
extern "C" {
#endif
aclError aclInit(const char *configPath);
aclError aclFinalize();
#ifdef __cplusplus
}
#endif
