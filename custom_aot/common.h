// Shared pieces of every CPU kernel: MindSpore's AOT ABI, tensor views, float16/bfloat16
// conversion, dtype dispatch and error reporting.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#define MOE_EXPORT extern "C" __attribute__((visibility("default")))

// ---------------------------------------------------------------------------------------------
// MindSpore AOT ABI. The header shipped in the wheel pulls in the whole framework, so this is a
// layout-compatible copy of mindspore::AotExtra (same virtual table order, same members). The
// getters are private there; here they are public so the kernels can call them directly.
namespace mindspore {
class AotKernelData {
 public:
  AotKernelData() = default;
  virtual ~AotKernelData() = default;
};

class AotExtra {
 public:
  AotExtra() = default;
  virtual ~AotExtra() = default;
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
  AotKernelData *kernel_data_{nullptr};
};
}  // namespace mindspore

namespace moe {

using Extra = mindspore::AotExtra;

// ---------------------------------------------------------------------------------------------
// Element types. float16 uses the compiler's _Float16 (F16C instructions with -march=native);
// bfloat16 is a 16-bit pattern converted by hand with round-to-nearest-even.
using f16 = _Float16;
struct bf16 {
  uint16_t bits;
};

inline float to_f32(float v) { return v; }
inline float to_f32(f16 v) { return static_cast<float>(v); }
inline float to_f32(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
inline T from_f32(float v);
template <>
inline float from_f32<float>(float v) { return v; }
template <>
inline f16 from_f32<f16>(float v) { return static_cast<f16>(v); }
template <>
inline bf16 from_f32<bf16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// Blocks of n elements to and from float32, vectorised where the CPU allows (GCC does not
// vectorise the scalar conversions above). Same results as to_f32/from_f32 element by element.
template <typename T>
inline void load_f32(const T *src, float *dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = to_f32(src[j]);
}
template <typename T>
inline void store_f32(const float *src, T *dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = from_f32<T>(src[j]);
}
#if defined(__F16C__)
template <>
inline void load_f32<f16>(const f16 *src, float *dst, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + j))));
  for (; j < n; ++j) dst[j] = to_f32(src[j]);
}
template <>
inline void store_f32<f16>(const float *src, f16 *dst, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm_storeu_si128((__m128i *)(dst + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
  for (; j < n; ++j) dst[j] = from_f32<f16>(src[j]);
}
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
template <>
inline void load_f32<bf16>(const bf16 *src, float *dst, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + j)));
    _mm512_storeu_si512(dst + j, _mm512_slli_epi32(h, 16));
  }
  for (; j < n; ++j) dst[j] = to_f32(src[j]);
}
template <>
inline void store_f32<bf16>(const float *src, bf16 *dst, int64_t n) {
  // round to nearest even on the bit pattern; NaN stays a quiet NaN (as from_f32<bf16>)
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512i u = _mm512_loadu_si512(src + j);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)(dst + j), _mm512_cvtepi32_epi16(r));
  }
  for (; j < n; ++j) dst[j] = from_f32<bf16>(src[j]);
}
#endif

enum class DType { kNone, kF32, kF16, kBF16, kF64, kI8, kI32, kI64, kU8, kU64, kBool, kOther };

inline DType parse_dtype(const char *s) {
  if (s == nullptr) return DType::kNone;
  static const struct { const char *name; DType t; } table[] = {
      {"none", DType::kNone}, {"float32", DType::kF32}, {"float16", DType::kF16},
      {"bfloat16", DType::kBF16}, {"float64", DType::kF64}, {"int8", DType::kI8},
      {"int32", DType::kI32}, {"int64", DType::kI64}, {"uint8", DType::kU8},
      {"uint64", DType::kU64}, {"bool", DType::kBool}};
  for (const auto &e : table)
    if (std::strcmp(s, e.name) == 0) return e.t;
  return DType::kOther;
}

// ---------------------------------------------------------------------------------------------
// A view of one kernel argument (input, output or workspace).
struct Arg {
  void *ptr = nullptr;
  int ndim = 0;
  const int64_t *shape = nullptr;
  DType dtype = DType::kNone;

  bool present() const { return ptr != nullptr && dtype != DType::kNone; }
  int64_t dim(int i) const { return i < 0 ? shape[ndim + i] : shape[i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  template <typename T>
  T *as() const { return static_cast<T *>(ptr); }
};

struct Args {
  int n;
  void **params;
  int *ndims;
  int64_t **shapes;
  const char **dtypes;
  Arg operator[](int i) const {
    Arg a;
    if (i < 0 || i >= n) return a;
    a.ptr = params[i];
    a.ndim = ndims[i];
    a.shape = shapes[i];
    a.dtype = parse_dtype(dtypes[i]);
    return a;
  }
};

// Prints one line "ms_moe_ops.<op>: <message>" to stderr and returns 1 (the kernel's failure
// code, which MindSpore turns into a RuntimeError).
inline int fail(const char *op, const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "ms_moe_ops.%s: %s\n", op, buf);
  std::fflush(stderr);
  return 1;
}

// Calls f(T{}) with T the C++ type of a floating dtype; returns 1 for any other dtype.
template <typename F>
inline int dispatch_float(const char *op, DType t, F &&f) {
  switch (t) {
    case DType::kF32: return f(float{});
    case DType::kF16: return f(f16{});
    case DType::kBF16: return f(bf16{});
    default: return fail(op, "unsupported floating dtype");
  }
}

// exp(x) for float32 within ~2 ulp, branch-free so that loops calling it vectorise (libm's expf
// does not without -ffast-math, which would break the NaN/inf handling elsewhere). The argument
// is clamped to [-87.3, 88.3]: results stay finite and normal.
inline float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : x;  // (NaN passes through both and gives NaN)
  x = x > 88.3f ? 88.3f : x;
  const float t = x * 1.44269504f + 12582912.f;  // round(x / ln 2) lands in t's low bits
  const float n = t - 12582912.f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;   // x - n ln 2, two-part ln 2
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  uint32_t tbits;
  std::memcpy(&tbits, &t, 4);
  const uint32_t bits = (tbits - 0x4B400000u + 127u) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// Numerically safe for any x (x = +-100 gives 0 and 1, never inf or NaN), and vectorisable.
inline float sigmoid(float x) { return 1.f / (1.f + exp_approx(-x)); }

}  // namespace moe
