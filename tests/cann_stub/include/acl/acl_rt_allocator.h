// Stub of CANN's acl/acl_rt_allocator.h: see acl_base.h.
#pragma once
#include "acl/acl_rt.h"
