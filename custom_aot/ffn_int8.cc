// MoeFFN int8 path (SPEC §4 quant path). Per expert, two int8 x int8 -> int32 matrix products;
// the dequantise / activate / requantise step is fused into the first product's store and the
// dequantise-to-output step into the second's.
//
// The products use vpdpbusd (AVX-512 VNNI), which multiplies UNSIGNED by signed bytes: x is fed
// as x + 128 (a bit flip) and 128 * colsum(W) is subtracted afterwards, folded into the bias.
// Integer sums wrap modulo 2^32 like the device's int32 accumulator, so the trick is exact.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "ffn.h"

// GCC 12 reports its own AVX-512 intrinsics (the `__Y = __Y` idiom) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace moe {
namespace {

constexpr const char *kOp = "moe_ffn";
constexpr int kMR = 6;          // rows of a register tile
constexpr int kNR = 64;         // columns of a register tile (4 vectors of 16 int32)
constexpr int64_t kRowChunk = 16 * kMR;  // rows of one parallel task

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// A dequant scale as the device uses it: only the top 19 bits of the float32 survive.
inline float truncated(uint32_t bits) {
  bits &= 0xFFFFE000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// deq_scale [E, N] (uint64 whose low 32 bits are a float32 pattern, or float32) -> float32.
std::vector<float> deq_scales(const Arg &d) {
  std::vector<float> out(d.numel());
  for (int64_t i = 0; i < d.numel(); ++i) {
    uint32_t bits;
    if (d.dtype == DType::kU64) {
      bits = static_cast<uint32_t>(d.as<uint64_t>()[i]);
    } else {
      std::memcpy(&bits, d.as<float>() + i, 4);
    }
    out[i] = truncated(bits);
  }
  return out;
}

// The right-hand int8 matrix B [K, N] (row-major) of one expert, packed for the register tile:
// panels of kNR columns, each [K/4][kNR][4] with K and N zero-padded; corr[n] = 128 * colsum.
struct PackedB {
  int64_t k4 = 0, n = 0, panels = 0;
  std::vector<int8_t> data;
  std::vector<int32_t> corr;

  void pack(const int8_t *b, int64_t k, int64_t n_) {
    n = n_;
    k4 = (k + 3) / 4;
    panels = (n + kNR - 1) / kNR;
    data.resize(panels * k4 * kNR * 4);
    corr.resize(panels * kNR);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      int8_t *dst = data.data() + p * k4 * kNR * 4;
      int32_t sum[kNR] = {};
      const int64_t c0 = p * kNR;
      for (int64_t q = 0; q < k4; ++q, dst += kNR * 4) {
        if (c0 + kNR <= n && q * 4 + 4 <= k) {
          // interior: branch-free, so the compiler turns it into byte shuffles
          const int8_t *r0 = b + q * 4 * n + c0, *r1 = r0 + n, *r2 = r1 + n, *r3 = r2 + n;
          for (int j = 0; j < kNR; ++j) {
            dst[j * 4] = r0[j];
            dst[j * 4 + 1] = r1[j];
            dst[j * 4 + 2] = r2[j];
            dst[j * 4 + 3] = r3[j];
            sum[j] += r0[j] + r1[j] + r2[j] + r3[j];
          }
          continue;
        }
        for (int64_t j = 0; j < kNR; ++j)
          for (int64_t t = 0; t < 4; ++t) {
            const int64_t row = q * 4 + t, col = c0 + j;
            const int8_t v = (row < k && col < n) ? b[row * n + col] : 0;
            dst[j * 4 + t] = v;
            sum[j] += v;
          }
      }
      for (int j = 0; j < kNR; ++j)
        corr[c0 + j] = static_cast<int32_t>(128u * static_cast<uint32_t>(sum[j]));
    }
  }
  const int8_t *panel(int64_t p) const { return data.data() + p * k4 * kNR * 4; }
};

// acc[r][j] = sum_k a_r[k] * B[k, panel column j] for kMR rows (unsigned a, K padded to 4).
void tile(const uint8_t *const *a, const int8_t *b, int64_t k4, int32_t (*acc)[kNR]) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  // Named accumulators: GCC spills an array of vectors to the stack on every step.
  static_assert(kMR == 6 && kNR == 64, "the register tile below is 6 x 64");
#define MOE_ROW(r) __m512i c##r##0 = _mm512_setzero_si512(), c##r##1 = c##r##0, c##r##2 = c##r##0, \
                           c##r##3 = c##r##0;
  MOE_ROW(0) MOE_ROW(1) MOE_ROW(2) MOE_ROW(3) MOE_ROW(4) MOE_ROW(5)
#undef MOE_ROW
  for (int64_t q = 0; q < k4; ++q) {
    const int8_t *bq = b + q * kNR * 4;
    const __m512i b0 = _mm512_loadu_si512(bq), b1 = _mm512_loadu_si512(bq + 64);
    const __m512i b2 = _mm512_loadu_si512(bq + 128), b3 = _mm512_loadu_si512(bq + 192);
#define MOE_ROW(r)                                           \
  {                                                          \
    int32_t four;                                            \
    std::memcpy(&four, a[r] + q * 4, 4);                     \
    const __m512i av = _mm512_set1_epi32(four);              \
    c##r##0 = _mm512_dpbusd_epi32(c##r##0, av, b0);          \
    c##r##1 = _mm512_dpbusd_epi32(c##r##1, av, b1);          \
    c##r##2 = _mm512_dpbusd_epi32(c##r##2, av, b2);          \
    c##r##3 = _mm512_dpbusd_epi32(c##r##3, av, b3);          \
  }
    MOE_ROW(0) MOE_ROW(1) MOE_ROW(2) MOE_ROW(3) MOE_ROW(4) MOE_ROW(5)
#undef MOE_ROW
  }
#define MOE_ROW(r)                                  \
  _mm512_storeu_si512(acc[r], c##r##0);             \
  _mm512_storeu_si512(acc[r] + 16, c##r##1);        \
  _mm512_storeu_si512(acc[r] + 32, c##r##2);        \
  _mm512_storeu_si512(acc[r] + 48, c##r##3);
  MOE_ROW(0) MOE_ROW(1) MOE_ROW(2) MOE_ROW(3) MOE_ROW(4) MOE_ROW(5)
#undef MOE_ROW
#else
  // Portable version of the same arithmetic (uint32 sums wrap like the instruction's).
  for (int r = 0; r < kMR; ++r) {
    uint32_t c[kNR] = {};
    for (int64_t q = 0; q < k4; ++q)
      for (int j = 0; j < kNR; ++j)
        for (int t = 0; t < 4; ++t)
          c[j] += static_cast<uint32_t>(a[r][q * 4 + t] * b[(q * kNR + j) * 4 + t]);
    for (int j = 0; j < kNR; ++j) acc[r][j] = static_cast<int32_t>(c[j]);
  }
#endif
}

// C = A [rows r0..r1 of a, row stride lda, unsigned] x B, handing every kMR x kNR tile of
// int32 sums to store(row, first column, rows, columns, acc). Tasks = (panel, row chunk) pairs,
// static schedule: each output element is computed by one thread in a fixed order.
template <typename Store>
void gemm(const uint8_t *a, int64_t lda, int64_t r0, int64_t r1, const PackedB &b,
          Store &&store) {
  const int64_t chunks = (r1 - r0 + kRowChunk - 1) / kRowChunk;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t p = 0; p < b.panels; ++p)
    for (int64_t ch = 0; ch < chunks; ++ch) {
      alignas(64) int32_t acc[kMR][kNR];
      const int64_t c0 = p * kNR, cols = std::min<int64_t>(kNR, b.n - c0);
      const int64_t end = std::min(r1, r0 + (ch + 1) * kRowChunk);
      for (int64_t i = r0 + ch * kRowChunk; i < end; i += kMR) {
        const int rows = static_cast<int>(std::min<int64_t>(kMR, end - i));
        const uint8_t *rp[kMR];
        for (int r = 0; r < kMR; ++r) rp[r] = a + (i + std::min(r, rows - 1)) * lda;
        tile(rp, b.panel(p), b.k4, acc);
        store(i, c0, rows, static_cast<int>(cols), acc);
      }
    }
}

// round half to even, then saturate to int8; NaN becomes 0.
inline int8_t saturate_int8(float v) {
  const float r = std::nearbyint(v);
  if (!(r == r)) return 0;
  return static_cast<int8_t>(std::min(127.f, std::max(-128.f, r)));
}

#if defined(__AVX512F__)
// Vector versions of `activate` for the requantising store (the scalar calls to expf would cost
// more than the matrix product). exp: Cephes' polynomial, within 2 ulp of expf.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 sigmoid_ps(__m512 z) {
  const __m512 one = _mm512_set1_ps(1.f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), z))));
}

inline __m512 activate_ps(Activation act, __m512 x) {
  switch (act) {
    case Activation::kFastGelu: return _mm512_mul_ps(x, sigmoid_ps(_mm512_mul_ps(_mm512_set1_ps(1.702f), x)));
    case Activation::kGelu: {
      const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
      const __m512 in = _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x);
      return _mm512_mul_ps(x, sigmoid_ps(_mm512_mul_ps(_mm512_set1_ps(1.59576912f), in)));
    }
    case Activation::kRelu: return _mm512_max_ps(x, _mm512_setzero_ps());
    case Activation::kSilu: return _mm512_mul_ps(x, sigmoid_ps(x));
    default: return x;
  }
}
#endif

// One row of the first product's store: dst[j] = q + 128 with
// q = int8(rint(act(float(acc[j] + bias[j]) * deq[j]) * s + o)).
inline void requantise(const int32_t *acc, const int32_t *bias, const float *deq, int cols,
                       Activation act, float s, float o, uint8_t *dst) {
  int j = 0;
#if defined(__AVX512F__)
  for (; j < cols; j += 16) {
    const __mmask16 m = cols - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cols - j)) - 1);
    const __m512i sum = _mm512_add_epi32(_mm512_loadu_si512(acc + j),
                                         _mm512_maskz_loadu_epi32(m, bias + j));
    const __m512 hv = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_maskz_loadu_ps(m, deq + j));
    __m512 v = _mm512_fmadd_ps(activate_ps(act, hv), _mm512_set1_ps(s), _mm512_set1_ps(o));
    v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);  // NaN -> 0
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-128.f)), _mm512_set1_ps(127.f));
    const __m512i q = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm512_mask_cvtepi32_storeu_epi8(dst + j, m, _mm512_xor_si512(q, _mm512_set1_epi32(0x80)));
  }
#endif
  for (; j < cols; ++j) {
    const int32_t sum = static_cast<int32_t>(static_cast<uint32_t>(acc[j]) +
                                             static_cast<uint32_t>(bias[j]));
    const float hv = static_cast<float>(sum) * deq[j];
    dst[j] = static_cast<uint8_t>(saturate_int8(std::fma(activate(act, hv), s, o)) ^ 0x80);
  }
}

struct Int8Args {
  Arg x, tokens, w1, b1, w2, b2, scale, offset, dq1, dq2, y;
};

int check(const Int8Args &a) {
  auto is_int = [](const Arg &t, DType d) { return t.present() && t.dtype == d; };
  auto is_deq = [](const Arg &t) {
    return t.present() && (t.dtype == DType::kU64 || t.dtype == DType::kF32);
  };
  if (!is_int(a.x, DType::kI8) || !is_int(a.w1, DType::kI8) || !is_int(a.w2, DType::kI8) ||
      !is_int(a.tokens, DType::kI64) || !is_int(a.scale, DType::kF32) || !is_deq(a.dq1) ||
      !is_deq(a.dq2) || (a.b1.present() && a.b1.dtype != DType::kI32) ||
      (a.b2.present() && a.b2.dtype != DType::kI32) ||
      (a.offset.present() && a.offset.dtype != DType::kF32))
    return fail(kOp, "int8 path: x, weight1, weight2 int8, bias1/bias2 int32, expert_tokens "
                     "int64, scale/offset float32, deq_scale1/2 uint64 or float32 are required");
  if (a.x.ndim != 2 || a.w1.ndim != 3 || a.w2.ndim != 3 || a.y.ndim != 2 || a.tokens.ndim != 1)
    return fail(kOp, "int8 path: x [M, H], weight1 [E, H, F], weight2 [E, F, H], y [M, H] expected");
  const int64_t m = a.x.dim(0), h = a.x.dim(1), e = a.tokens.dim(0), f = a.w1.dim(2);
  auto is = [](const Arg &t, std::initializer_list<int64_t> s) {
    if (t.ndim != static_cast<int>(s.size())) return false;
    int i = 0;
    for (int64_t v : s)
      if (t.dim(i++) != v) return false;
    return true;
  };
  if (!is(a.w1, {e, h, f}) || !is(a.w2, {e, f, h}) || !is(a.y, {m, h}) ||
      (a.b1.present() && !is(a.b1, {e, f})) || (a.b2.present() && !is(a.b2, {e, h})) ||
      !is(a.scale, {e}) || (a.offset.present() && !is(a.offset, {e})) || !is(a.dq1, {e, f}) ||
      !is(a.dq2, {e, h}))
    return fail(kOp, "int8 path: argument shapes do not match x [%lld, %lld], E = %lld, F = %lld",
                (long long)m, (long long)h, (long long)e, (long long)f);
  return 0;
}

template <typename T>
int run(const Int8Args &a, Activation act, const std::vector<int64_t> &offsets) {
  const int64_t m = a.x.dim(0), h = a.x.dim(1), e = a.tokens.dim(0), f = a.w1.dim(2);
  const int64_t hp = round_up(h, 4), fp = round_up(f, 4);
  const std::vector<float> dq1 = deq_scales(a.dq1), dq2 = deq_scales(a.dq2);
  // x + 128 as unsigned bytes, rows padded to a multiple of 4 (padding meets zero weights).
  std::vector<uint8_t> xu(m * hp, 0), qu(m * fp, 0);
  const int8_t *x = a.x.as<int8_t>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i)
    for (int64_t k = 0; k < h; ++k) xu[i * hp + k] = static_cast<uint8_t>(x[i * h + k] ^ 0x80);

  PackedB b;
  std::vector<int32_t> bias(std::max(f, h));
  T *y = a.y.as<T>();
  for (int64_t ex = 0; ex < e; ++ex) {
    const int64_t r0 = offsets[ex], r1 = offsets[ex + 1];
    if (r0 == r1) continue;
    const float s = a.scale.as<float>()[ex];
    const float o = a.offset.present() ? a.offset.as<float>()[ex] : 0.f;

    // h = (x @ w1 + b1) * dq1; q = int8(rint(act(h) * scale + offset)), stored as q + 128.
    b.pack(a.w1.as<int8_t>() + ex * h * f, h, f);
    for (int64_t j = 0; j < f; ++j)
      bias[j] = static_cast<int32_t>(
          static_cast<uint32_t>(a.b1.present() ? a.b1.as<int32_t>()[ex * f + j] : 0) -
          static_cast<uint32_t>(b.corr[j]));
    const float *d1 = dq1.data() + ex * f;
    gemm(xu.data(), hp, r0, r1, b, [&](int64_t i, int64_t c0, int rows, int cols,
                                       const int32_t (*acc)[kNR]) {
      for (int r = 0; r < rows; ++r)
        requantise(acc[r], bias.data() + c0, d1 + c0, cols, act, s, o,
                   qu.data() + (i + r) * fp + c0);
    });

    // y = (q @ w2 + b2) * dq2
    b.pack(a.w2.as<int8_t>() + ex * f * h, f, h);
    for (int64_t j = 0; j < h; ++j)
      bias[j] = static_cast<int32_t>(
          static_cast<uint32_t>(a.b2.present() ? a.b2.as<int32_t>()[ex * h + j] : 0) -
          static_cast<uint32_t>(b.corr[j]));
    const float *d2 = dq2.data() + ex * h;
    gemm(qu.data(), fp, r0, r1, b, [&](int64_t i, int64_t c0, int rows, int cols,
                                       const int32_t (*acc)[kNR]) {
      for (int r = 0; r < rows; ++r) {
        T *dst = y + (i + r) * h + c0;
        for (int j = 0; j < cols; ++j) {
          const int32_t sum = static_cast<int32_t>(static_cast<uint32_t>(acc[r][j]) +
                                                   static_cast<uint32_t>(bias[c0 + j]));
          dst[j] = from_f32<T>(static_cast<float>(sum) * d2[c0 + j]);
        }
      }
    });
  }
  return 0;
}

}  // namespace

// params: x, expert_tokens, weight1, bias1, weight2, bias2, scale, offset, deq_scale1,
// deq_scale2, then y.
int moe_ffn_int8(const Args &args, Extra *extra) {
  if (args.n < 11) return fail(kOp, "int8 path: expected 11 arguments, got %d", args.n);
  const Int8Args a{args[0], args[1], args[2], args[3], args[4], args[5],
                   args[6], args[7], args[8], args[9], args[10]};
  if (int rc = check(a)) return rc;
  const Activation act = parse_activation(extra->GetAttrStr("activation"));
  if (act == Activation::kUnknown) return fail(kOp, "unknown activation");
  std::vector<int64_t> offsets;
  if (int rc = expert_offsets(kOp, a.tokens, extra->GetAttrBool("tokens_index_flag"),
                              a.x.dim(0), offsets))
    return rc;
  return dispatch_float(kOp, a.y.dtype, [&](auto t) { return run<decltype(t)>(a, act, offsets); });
}

}  // namespace moe
