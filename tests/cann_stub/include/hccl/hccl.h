// Stub of CANN's hccl/hccl.h (HCCL API reference): see acl/acl_base.h for what this tree is.
#pragma once
#include "hccl/hccl_types.h"
#include "acl/acl.h"
