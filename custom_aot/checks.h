// Entry-point validation shared by every kernel: a kernel is called through MindSpore's AOT ABI by
// whatever front end built the graph (a MINDIR loaded elsewhere runs no Python inference), so it
// checks the argument count, every dtype and every shape relation it relies on before it reads
// data or writes anything. Each check reports through fail(): one line naming the operator, the
// argument, what was expected and what was given.
#pragma once

#include <initializer_list>
#include <string>

#include "common.h"

namespace moe {
inline namespace MOE_ISA_NS {

// Largest element count any tensor may have: sizes multiply in int64 without overflow below it.
constexpr int64_t kMaxElements = int64_t(1) << 48;

inline const char *dtype_label(DType t) {
  switch (t) {
    case DType::kNone: return "none";
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kF64: return "float64";
    case DType::kI8: return "int8";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    case DType::kU8: return "uint8";
    case DType::kU64: return "uint64";
    case DType::kBool: return "bool";
    default: return "another dtype";
  }
}

inline std::string shape_label(const Arg &a) {
  std::string s = "[";
  for (int i = 0; i < a.ndim; ++i) s += (i ? ", " : "") + std::to_string(a.shape[i]);
  return s + "]";
}

inline bool is_float(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

// An optional argument is given when its dtype is not "none" (its pointer may be null when it
// has no elements).
inline bool given(const Arg &a) { return a.dtype != DType::kNone; }

// Every kernel first: exactly `want` parameters (inputs, then outputs).
inline int check_count(const char *op, const Args &args, int want) {
  if (args.n != want || args.params == nullptr || args.ndims == nullptr || args.shapes == nullptr ||
      args.dtypes == nullptr)
    return fail(op, "expected %d arguments (inputs, then outputs), got %d", want, args.n);
  return 0;
}

// A sound tensor description: rank 0..8 with a shape array, no negative dimension, at most
// kMaxElements elements, and data behind any tensor that has elements.
inline int check_sound(const char *op, const char *name, const Arg &a) {
  if (a.ndim < 0 || a.ndim > 8 || (a.ndim > 0 && a.shape == nullptr))
    return fail(op, "'%s' has an invalid rank %d", name, a.ndim);
  int64_t n = 1;
  for (int i = 0; i < a.ndim; ++i) {
    if (a.shape[i] < 0) return fail(op, "'%s' has a negative dimension: %s", name, shape_label(a).c_str());
    if (a.shape[i] > 0 && n > kMaxElements / a.shape[i])
      return fail(op, "'%s' is too large: %s", name, shape_label(a).c_str());
    n *= a.shape[i];
  }
  if (n > 0 && a.ptr == nullptr) return fail(op, "'%s' %s has no data", name, shape_label(a).c_str());
  return 0;
}

// A required argument of one of the dtypes listed, of rank `ndim` (-1: any rank).
inline int check_arg(const char *op, const char *name, const Arg &a, int ndim,
                     std::initializer_list<DType> dtypes) {
  if (!given(a)) return fail(op, "'%s' is required, got none", name);
  if (int rc = check_sound(op, name, a)) return rc;
  bool ok = false;
  for (DType d : dtypes) ok = ok || a.dtype == d;
  if (!ok) return fail(op, "'%s' has dtype %s, which is not allowed here", name, dtype_label(a.dtype));
  if (ndim >= 0 && a.ndim != ndim)
    return fail(op, "'%s' must be %d-D, got shape %s", name, ndim, shape_label(a).c_str());
  return 0;
}

// A required argument of exactly this dtype and shape.
inline int check_exact(const char *op, const char *name, const Arg &a, DType dtype,
                       std::initializer_list<int64_t> shape) {
  if (int rc = check_arg(op, name, a, static_cast<int>(shape.size()), {dtype})) return rc;
  int i = 0;
  for (int64_t d : shape) {
    if (a.shape[i++] != d) {
      std::string want = "[";
      int j = 0;
      for (int64_t v : shape) want += (j++ ? ", " : "") + std::to_string(v);
      return fail(op, "'%s' must have shape %s, got %s", name, (want + "]").c_str(),
                  shape_label(a).c_str());
    }
  }
  return 0;
}

// An optional argument: absent, or exactly this dtype and shape.
inline int check_optional(const char *op, const char *name, const Arg &a, DType dtype,
                          std::initializer_list<int64_t> shape) {
  return given(a) ? check_exact(op, name, a, dtype, shape) : 0;
}

// An argument that must be absent on this path.
inline int check_absent(const char *op, const char *name, const Arg &a, const char *why) {
  return given(a) ? fail(op, "'%s' must be none (%s), got %s", name, why, dtype_label(a.dtype)) : 0;
}

// Same dtype and shape as `like`, for a tensor whose shape is another's.
inline int check_like(const char *op, const char *name, const Arg &a, const Arg &like) {
  if (int rc = check_arg(op, name, a, like.ndim, {like.dtype})) return rc;
  for (int i = 0; i < like.ndim; ++i)
    if (a.shape[i] != like.shape[i])
      return fail(op, "'%s' must have shape %s, got %s", name, shape_label(like).c_str(),
                  shape_label(a).c_str());
  return 0;
}

}  // namespace MOE_ISA_NS
}  // namespace moe
