// Shared pieces of every CPU kernel: MindSpore's AOT ABI, tensor views, float16/bfloat16
// conversion, dtype dispatch and error reporting.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "isa.h"

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
inline namespace MOE_ISA_NS {

using Extra = mindspore::AotExtra;

// A parallel region wakes the OpenMP threads, which sleep between kernels (OMP_WAIT_POLICY=
// PASSIVE: MindSpore's own threads need the cores): some 70 microseconds, ten times what a
// decoding step's small kernels take on one thread. Work touching fewer bytes stays on it.
constexpr int64_t kParallelBytes = 256 << 10;
inline bool worth_threads(int64_t bytes) { return bytes >= kParallelBytes; }

// ---------------------------------------------------------------------------------------------
// Element types: 16-bit patterns converted to and from float32 with round-to-nearest-even (NaN
// stays a quiet NaN). float16 uses the hardware where the path has it (F16C, aarch64's FCVT),
// else exact integer arithmetic.
struct f16 {
  uint16_t bits;
};
struct bf16 {
  uint16_t bits;
};

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float to_f32(float v) { return v; }
inline float to_f32(bf16 v) { return bits_f32(static_cast<uint32_t>(v.bits) << 16); }

inline float half_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#elif defined(__aarch64__)
  __fp16 v;
  std::memcpy(&v, &h, 2);
  return v;
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu,
                 m = h & 0x3ffu;
  if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u));
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float32
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((e + 112) << 23) | (m << 13));
#endif
}

inline uint16_t f32_to_half(float v) {
#if defined(__F16C__)
  return static_cast<uint16_t>(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
#elif defined(__aarch64__)
  const __fp16 h = v;
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
#else
  uint32_t u = f32_bits(v);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7e00u | ((u >> 13) & 0x3ffu);  // NaN, quiet
  if (u >= 0x47800000u) return sign | 0x7c00u;                         // >= 2^16: inf
  const uint32_t e = u >> 23;
  if (e >= 113) {  // normal: rebias the exponent, round the mantissa (a carry may reach inf)
    u -= 112u << 23;
    u += 0xfffu + ((u >> 13) & 1u);
    return sign | static_cast<uint16_t>(u >> 13);
  }
  if (e < 102) return sign;  // below 2^-25: rounds to zero
  // subnormal: the 24-bit significand in units of 2^-24 (a carry may give the smallest normal)
  const uint32_t m = (u & 0x7fffffu) | 0x800000u, shift = 126 - e;
  const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  return sign | static_cast<uint16_t>(q + (rem > half || (rem == half && (q & 1u))));
#endif
}

inline float to_f32(f16 v) { return half_to_f32(v.bits); }

template <typename T>
inline T from_f32(float v);
template <>
inline float from_f32<float>(float v) { return v; }
template <>
inline f16 from_f32<f16>(float v) { return f16{f32_to_half(v)}; }
template <>
inline bf16 from_f32<bf16>(float v) {
  uint32_t u = f32_bits(v);
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
#if defined(__AVX2__) && !defined(__AVX512BW__)
// bfloat16 on 8 lanes, the same arithmetic as the AVX-512 version below
template <>
inline void load_f32<bf16>(const bf16 *src, float *dst, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + j)));
    _mm256_storeu_si256((__m256i *)(dst + j), _mm256_slli_epi32(h, 16));
  }
  for (; j < n; ++j) dst[j] = to_f32(src[j]);
}
// 8 floats rounded to bfloat16 bit patterns in the low halves of 32-bit lanes
inline __m256i bf16_bits(__m256i u) {
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  // (a signed compare: both sides are below 2^31 once the sign is masked off)
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(r, quiet, nan);
}
template <>
inline void store_f32<bf16>(const float *src, bf16 *dst, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {  // two vectors packed into one store (packus works per 128 bits)
    const __m256i lo = bf16_bits(_mm256_loadu_si256((const __m256i *)(src + j)));
    const __m256i hi = bf16_bits(_mm256_loadu_si256((const __m256i *)(src + j + 8)));
    _mm256_storeu_si256((__m256i *)(dst + j), _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8));
  }
  for (; j < n; ++j) dst[j] = from_f32<bf16>(src[j]);
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

#if defined(__aarch64__)
// NEON: FCVT converts float16 (rounding to nearest even, as the scalar conversion), bfloat16 is
// the top half of a float32 (rounded to nearest even on the bit pattern, as from_f32<bf16>).
template <>
inline void load_f32<f16>(const f16 *src, float *dst, int64_t n) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4)
    vst1q_f32(dst + j, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(&src[j].bits))));
  for (; j < n; ++j) dst[j] = to_f32(src[j]);
}
template <>
inline void store_f32<f16>(const float *src, f16 *dst, int64_t n) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4)
    vst1_u16(&dst[j].bits, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(src + j))));
  for (; j < n; ++j) dst[j] = from_f32<f16>(src[j]);
}
template <>
inline void load_f32<bf16>(const bf16 *src, float *dst, int64_t n) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4)
    vst1q_f32(dst + j, vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(&src[j].bits), 16)));
  for (; j < n; ++j) dst[j] = to_f32(src[j]);
}
template <>
inline void store_f32<bf16>(const float *src, bf16 *dst, int64_t n) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const uint32x4_t u = vreinterpretq_u32_f32(vld1q_f32(src + j));
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint16x4_t r = vshrn_n_u32(vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), lsb)), 16);
    const uint16x4_t quiet = vorr_u16(vshrn_n_u32(u, 16), vdup_n_u16(0x40));
    const uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffff)), vdupq_n_u32(0x7f800000));
    vst1_u16(&dst[j].bits, vbsl_u16(vmovn_u32(nan), quiet, r));
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

// Prints one line "ms_moe_ops.<op>: <message>" to stderr, records it as the call's error and
// returns 1 (the kernel's failure code: the exported entry point then throws the message, which
// MindSpore raises as a RuntimeError).
inline int fail(const char *op, const char *fmt, ...) {
  char buf[512], line[640];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::snprintf(line, sizeof(line), "ms_moe_ops.%s: %s", op, buf);
  std::fprintf(stderr, "%s\n", line);
  std::fflush(stderr);
  dispatch::record_error(line);
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

// cond ? a : b as a select of bits. Written as `cond ? a : b`, GCC moves the arithmetic that
// follows into both sides (e.g. `x = x < c ? c : x; y = x * k` becomes two products, one of
// them constant-folded), and then cannot vectorise the loop without AVX-512's masked moves:
// arithmetic that may raise a floating-point exception is not executed on the side not taken.
// A bit select keeps one straight-line path on every instruction set.
inline float pick(bool cond, float a, float b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(cond);
  return bits_f32((f32_bits(a) & mask) | (f32_bits(b) & ~mask));
}
inline float min_of(float a, float b) { return pick(b < a, b, a); }  // std::min: NaN a -> a
inline float max_of(float a, float b) { return pick(a < b, b, a); }  // std::max: NaN a -> a

// exp(x) for float32 within ~2 ulp, branch-free so that loops calling it vectorise (libm's expf
// does not without -ffast-math, which would break the NaN/inf handling elsewhere). The argument
// is clamped to [-87.3, 88.3]: results stay finite and normal.
inline float exp_approx(float x) {
  x = min_of(max_of(x, -87.3f), 88.3f);  // (NaN passes through both and gives NaN)
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

}  // namespace MOE_ISA_NS
}  // namespace moe
