// Stub of CANN's graph/tensor.h (GE graph API): see graph/types.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "graph/types.h"

namespace ge {
class Shape {
 public:
  Shape() = default;
  explicit Shape(const std::vector<int64_t> &dims);
  size_t GetDimNum() const;
  int64_t GetDim(size_t idx) const;
  std::vector<int64_t> GetDims() const;
  int64_t GetShapeSize() const;
};

class TensorDesc {
 public:
  TensorDesc();
  explicit TensorDesc(Shape shape, Format format = FORMAT_ND, DataType dt = DT_FLOAT);
  Shape GetShape() const;
  void SetShape(const Shape &shape);
  Format GetFormat() const;
  void SetFormat(Format format);
  Shape GetOriginShape() const;
  void SetOriginShape(const Shape &origin_shape);
  Format GetOriginFormat() const;
  void SetOriginFormat(Format origin_format);
  DataType GetDataType() const;
  void SetDataType(DataType dt);
  void SetPlacement(Placement placement);
};

class Tensor {
 public:
  Tensor();
  explicit Tensor(const TensorDesc &tensor_desc);
  Tensor(const TensorDesc &tensor_desc, const uint8_t *data, size_t size);
  TensorDesc GetTensorDesc() const;
  graphStatus SetTensorDesc(const TensorDesc &tensor_desc);
  const uint8_t *GetData() const;
  uint8_t *GetData();
  size_t GetSize() const;
  graphStatus SetData(const uint8_t *data, size_t size);
};
}  // namespace ge
