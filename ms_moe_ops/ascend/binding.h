// What every generated binding of ms_moe_ops/ops/_extension.py shares: the operator's outputs
// from the shapes and dtypes its declaration inferred (passed as `out_spec`), the output
// inference MindSpore's GRAPH mode calls (OpFuncImpl), the prototype check against the
// installed aclnn header, and (CPU builds) the call of this package's CPU kernel through its AOT
// ABI. Compiled by MindSpore's CustomOpBuilder with the generated source that includes it.
#pragma once
#include <dlfcn.h>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ms_extension/api.h"
#include "prototype.h"
#include "mindspore/core/include/ops/ops_func_impl/op_func_impl.h"

namespace moe_ext {
using mindspore::ShapeVector;
using mindspore::TypeId;

// out_spec: [n, (dtype code, rank, dims...) x n], dtype codes in the order of kDtypes (the
// Python side's DTYPE_CODES).
inline TypeId DtypeOf(int64_t code) {
  static const TypeId kDtypes[] = {
    TypeId::kNumberTypeFloat32, TypeId::kNumberTypeFloat16, TypeId::kNumberTypeBFloat16,
    TypeId::kNumberTypeInt8,    TypeId::kNumberTypeInt32,   TypeId::kNumberTypeInt64,
    TypeId::kNumberTypeUInt64,  TypeId::kNumberTypeBool,    TypeId::kNumberTypeUInt8};
  if (code < 0 || code >= static_cast<int64_t>(sizeof(kDtypes) / sizeof(kDtypes[0]))) {
    MS_LOG(EXCEPTION) << "ms_moe_ops: unknown dtype code " << code << " in out_spec";
  }
  return kDtypes[code];
}

struct OutSpec {
  std::vector<ShapeVector> shapes;
  std::vector<TypeId> dtypes;
};

inline OutSpec DecodeSpec(const std::vector<int64_t> &spec) {
  OutSpec out;
  size_t at = 1;
  for (int64_t i = 0; spec.size() > 0 && i < spec[0]; ++i) {
    if (at + 2 > spec.size()) MS_LOG(EXCEPTION) << "ms_moe_ops: truncated out_spec";
    out.dtypes.push_back(DtypeOf(spec[at]));
    auto rank = static_cast<size_t>(spec[at + 1]);
    at += 2;
    if (at + rank > spec.size()) MS_LOG(EXCEPTION) << "ms_moe_ops: truncated out_spec";
    out.shapes.emplace_back(spec.begin() + at, spec.begin() + at + rank);
    at += rank;
  }
  return out;
}

// The (empty) output tensors of one call.
inline std::vector<ms::Tensor> Outputs(const std::vector<int64_t> &spec) {
  auto decoded = DecodeSpec(spec);
  std::vector<ms::Tensor> out;
  for (size_t i = 0; i < decoded.shapes.size(); ++i) out.emplace_back(decoded.dtypes[i], decoded.shapes[i]);
  return out;
}

// The tensors of a call that are present (what a runner prepares on the device).
inline std::vector<ms::Tensor> Present(const std::vector<std::optional<ms::Tensor>> &tensors) {
  std::vector<ms::Tensor> out;
  for (const auto &t : tensors) {
    if (t.has_value() && t->is_defined()) out.push_back(*t);
  }
  return out;
}

// A small count tensor's values on the host (aclnnMoeFFN's expertTokens, PyNative mode).
inline std::vector<int64_t> HostValues(const ms::Tensor &t) {
  if (t.data_type() != TypeId::kNumberTypeInt64) {
    MS_LOG(EXCEPTION) << "ms_moe_ops: a host int array is read from an int64 tensor only";
  }
  auto host = t.tensor()->cpu();
  auto data = static_cast<const int64_t *>(host->data_c());
  return std::vector<int64_t>(data, data + host->DataSize());
}

// GRAPH mode: shapes and dtypes from out_spec (input `Spec`, a constant of the graph); `Host...`
// are the inputs whose values the kernel reads on the host each step (value-depend).
template <int64_t Spec, int64_t... Host>
class SpecFuncImpl : public mindspore::ops::OpFuncImpl {
 public:
  mindspore::ShapeArray InferShape(const mindspore::PrimitivePtr &,
                                   const mindspore::ops::InferInfoPtrList &infos) const override {
    return DecodeSpec(Spec_(infos)).shapes;
  }
  std::vector<TypeId> InferType(const mindspore::PrimitivePtr &,
                                const mindspore::ops::InferInfoPtrList &infos) const override {
    return DecodeSpec(Spec_(infos)).dtypes;
  }
  std::set<int64_t> GetValueDependArgIndices() const override { return {Spec, Host...}; }
  bool GeneralInferRegistered() const override { return true; }

 private:
  static std::vector<int64_t> Spec_(const mindspore::ops::InferInfoPtrList &infos) {
    auto value = infos[Spec]->template GetArrayValue<int64_t>();
    if (!value.has_value() || value->HasUnknownValue()) {
      MS_LOG(EXCEPTION) << "ms_moe_ops: the output shapes must be known when the graph is built";
    }
    return value->ToVector();
  }
};

#ifndef CUSTOM_ASCEND_OP
// CPU builds: this package's CPU kernel through MindSpore's AOT ABI, its attributes served by
// an object with mindspore::AotExtra's virtual table (custom_aot/common.h keeps the same copy).
class AotExtraBase {
 public:
  virtual ~AotExtraBase() = default;
  virtual bool HasAttr(std::string name) = 0;
  virtual bool GetAttrBool(std::string name) = 0;
  virtual int64_t GetAttrInt(std::string name) = 0;
  virtual float GetAttrFloat(std::string name) = 0;
  virtual std::string GetAttrStr(std::string name) = 0;
  virtual std::vector<int64_t> GetAttrIntVec(std::string name) = 0;
  virtual std::vector<float> GetAttrFloatVec(std::string name) = 0;
  virtual std::vector<std::vector<int64_t>> GetAttrInt2DVec(std::string name) = 0;
  virtual std::vector<std::vector<float>> GetAttrFloat2DVec(std::string name) = 0;
  std::vector<size_t> workspace_;
  void *kernel_data_{nullptr};
};

struct Attrs {
  std::map<std::string, int64_t> ints;
  std::map<std::string, double> floats;
  std::map<std::string, std::string> strs;
  void Set(const std::string &name, bool v) { ints[name] = v; }
  void Set(const std::string &name, int64_t v) { ints[name] = v; }
  void Set(const std::string &name, double v) { floats[name] = v; }
  void Set(const std::string &name, const std::string &v) { strs[name] = v; }
};

class AttrExtra : public AotExtraBase {
 public:
  explicit AttrExtra(Attrs attrs) : a_(std::move(attrs)) {}
  bool HasAttr(std::string n) override { return a_.ints.count(n) || a_.floats.count(n) || a_.strs.count(n); }
  bool GetAttrBool(std::string n) override { return a_.ints.at(n) != 0; }
  int64_t GetAttrInt(std::string n) override { return a_.ints.at(n); }
  float GetAttrFloat(std::string n) override { return static_cast<float>(a_.floats.at(n)); }
  std::string GetAttrStr(std::string n) override { return a_.strs.at(n); }
  std::vector<int64_t> GetAttrIntVec(std::string) override { return {}; }
  std::vector<float> GetAttrFloatVec(std::string) override { return {}; }
  std::vector<std::vector<int64_t>> GetAttrInt2DVec(std::string) override { return {}; }
  std::vector<std::vector<float>> GetAttrFloat2DVec(std::string) override { return {}; }

 private:
  Attrs a_;
};

using AotKernel = int (*)(int, void **, int *, int64_t **, const char **, void *, void *);

inline void *&KernelLibrary() {
  static void *handle = nullptr;
  return handle;
}

// Called once from Python with the path of the compiled CPU kernel library.
inline void SetKernelLibrary(const std::string &path) {
  KernelLibrary() = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (KernelLibrary() == nullptr) MS_LOG(EXCEPTION) << "ms_moe_ops: cannot load " << path << ": " << dlerror();
}

inline const char *DtypeName(const ms::Tensor &t) {
  switch (t.data_type()) {
    case TypeId::kNumberTypeFloat32: return "float32";
    case TypeId::kNumberTypeFloat16: return "float16";
    case TypeId::kNumberTypeBFloat16: return "bfloat16";
    case TypeId::kNumberTypeInt8: return "int8";
    case TypeId::kNumberTypeInt32: return "int32";
    case TypeId::kNumberTypeInt64: return "int64";
    case TypeId::kNumberTypeUInt64: return "uint64";
    case TypeId::kNumberTypeBool: return "bool";
    case TypeId::kNumberTypeUInt8: return "uint8";
    default: return "other";
  }
}

// Runs the CPU kernel `symbol` on every argument (inputs in the declaration's order, absent ones
// as null pointers with dtype "none", then the outputs).
class CpuKernelRunner : public ms::pynative::PyboostRunner {
 public:
  CpuKernelRunner(const std::string &symbol, std::vector<std::optional<ms::Tensor>> args, Attrs attrs)
      : PyboostRunner(symbol), symbol_(symbol), args_(std::move(args)), extra_(std::move(attrs)) {}
  void LaunchKernel() override {
    auto kernel = reinterpret_cast<AotKernel>(dlsym(KernelLibrary(), symbol_.c_str()));
    if (kernel == nullptr) MS_LOG(EXCEPTION) << "ms_moe_ops: no CPU kernel " << symbol_;
    std::vector<void *> params;
    std::vector<int> ndims;
    std::vector<int64_t *> shapes;
    std::vector<const char *> dtypes;
    std::vector<ShapeVector> keep;
    auto add = [&](const ms::Tensor *t) {
      keep.push_back(t == nullptr ? ShapeVector{} : t->shape());
      params.push_back(t == nullptr ? nullptr : t->GetDataPtr());
      dtypes.push_back(t == nullptr ? "none" : DtypeName(*t));
    };
    size_t next = 0;
    for (const auto &a : args_) add(a.has_value() && a->is_defined() ? &inputs()[next++] : nullptr);
    for (const auto &o : outputs()) add(&o);
    for (auto &s : keep) {
      ndims.push_back(static_cast<int>(s.size()));
      shapes.push_back(s.data());
    }
    int status = kernel(static_cast<int>(params.size()), params.data(), ndims.data(), shapes.data(),
                        dtypes.data(), nullptr, &extra_);
    if (status != 0) MS_LOG(EXCEPTION) << "ms_moe_ops: CPU kernel " << symbol_ << " returned " << status;
  }
  static void Launch(const std::string &symbol, const std::vector<std::optional<ms::Tensor>> &args,
                     const std::vector<ms::Tensor> &outputs, Attrs attrs) {
    auto runner = std::make_shared<CpuKernelRunner>(symbol, args, std::move(attrs));
    runner->Run(Present(args), outputs);
  }

 private:
  std::string symbol_;
  std::vector<std::optional<ms::Tensor>> args_;
  AttrExtra extra_;
};
#endif  // CUSTOM_ASCEND_OP
}  // namespace moe_ext
