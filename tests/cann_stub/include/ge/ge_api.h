// Stub of CANN's ge/ge_api.h (GE graph API): see graph/types.h.
#pragma once
#include <map>
#include <memory>
#include <string>
#include "graph/graph.h"
#include "graph/tensor.h"

namespace ge {
class Allocator {
 public:
  virtual ~Allocator() = default;
};
using AllocatorPtr = std::shared_ptr<Allocator>;
using Status = uint32_t;
const Status SUCCESS = 0;
const Status FAILED = 0xFFFFFFFF;
}  // namespace ge
