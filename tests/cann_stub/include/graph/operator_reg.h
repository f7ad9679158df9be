// Stub of CANN's graph/operator_reg.h (GE graph API): see graph/types.h.
#pragma once
#include "graph/operator.h"
