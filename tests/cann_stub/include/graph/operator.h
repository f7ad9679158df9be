// Stub of CANN's graph/operator.h (GE graph API): see graph/types.h.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>
#include "graph/tensor.h"

namespace ge {
class Operator;
using OperatorPtr = std::shared_ptr<Operator>;

class Operator {
 public:
  Operator() = default;
  explicit Operator(const std::string &type);
  Operator(const std::string &name, const std::string &type);
  virtual ~Operator() = default;
  std::string GetName() const;
  std::string GetOpType() const;
  Operator &SetInput(const std::string &dst_name, const Operator &src_oprt);
  Operator &SetInput(const std::string &dst_name, const Operator &src_oprt, const std::string &name);
  Operator &SetInput(uint32_t dst_index, const Operator &src_oprt, uint32_t src_index);
  TensorDesc GetInputDesc(const std::string &name) const;
  TensorDesc GetInputDesc(uint32_t index) const;
  graphStatus UpdateInputDesc(const std::string &name, const TensorDesc &tensor_desc);
  TensorDesc GetOutputDesc(const std::string &name) const;
  TensorDesc GetOutputDesc(uint32_t index) const;
  graphStatus UpdateOutputDesc(const std::string &name, const TensorDesc &tensor_desc);
  TensorDesc GetDynamicInputDesc(const std::string &name, uint32_t index) const;
  graphStatus UpdateDynamicInputDesc(const std::string &name, uint32_t index, const TensorDesc &tensor_desc);
  TensorDesc GetDynamicOutputDesc(const std::string &name, uint32_t index) const;
  graphStatus UpdateDynamicOutputDesc(const std::string &name, uint32_t index, const TensorDesc &tensor_desc);
  size_t GetInputsSize() const;
  size_t GetOutputsSize() const;
  Operator &SetAttr(const std::string &name, int64_t attr_value);
  Operator &SetAttr(const std::string &name, float attr_value);
  Operator &SetAttr(const std::string &name, bool attr_value);
  Operator &SetAttr(const std::string &name, const std::string &attr_value);
  Operator &SetAttr(const std::string &name, const std::vector<int64_t> &attr_value);

 protected:
  void InputRegister(const std::string &name);
  void OptionalInputRegister(const std::string &name);
  void OutputRegister(const std::string &name);
  void RequiredAttrRegister(const std::string &name);
  void DynamicInputRegister(const std::string &name, const unsigned int num, bool is_push_back = true);
  void DynamicOutputRegister(const std::string &name, const unsigned int num, bool is_push_back = true);
  void InferFuncRegister(const std::function<graphStatus(Operator &)> &func);
};

using OpCreator = std::function<Operator(const std::string &)>;
class OperatorFactory {
 public:
  static Operator CreateOperator(const std::string &operator_name, const std::string &operator_type);
  static graphStatus GetOpsTypeList(std::vector<std::string> &all_ops);
  static bool IsExistOp(const std::string &operator_type);
};
}  // namespace ge
