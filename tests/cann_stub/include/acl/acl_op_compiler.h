// Stub of CANN's acl/acl_op_compiler.h: see acl_base.h.
#pragma once
#include "acl/acl_op.h"
