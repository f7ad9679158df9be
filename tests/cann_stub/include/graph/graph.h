// Stub of CANN's graph/graph.h (GE graph API): see graph/types.h.
#pragma once
#include <memory>
#include <string>
#include <vector>
#include "graph/operator.h"

namespace ge {
class Graph {
 public:
  Graph() = default;
  explicit Graph(const std::string &name);
  Graph &SetInputs(const std::vector<Operator> &inputs);
  Graph &SetOutputs(const std::vector<Operator> &outputs);
};
using GraphPtr = std::shared_ptr<Graph>;
}  // namespace ge
