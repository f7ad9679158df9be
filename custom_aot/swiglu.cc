// SwiGLU kernels (SPEC §3): swiglu_group (forward, also returns the un-weighted y_origin) and
// swiglu_group_quant_grad (the seed's SwigluGroupQuantGrad). Both are memory bound: one pass over
// every tensor, rows in parallel, branch-free float32 inner loops the compiler vectorises over
// L1-sized blocks (float16/bfloat16 converted block by block), large outputs streamed.
#include <algorithm>
#include <type_traits>

#include "checks.h"
#include "common.h"

namespace moe {
inline namespace MOE_ISA_NS {
namespace {

// sigma(a) and 1 - sigma(a), both from e^-|a| so neither overflows nor cancels (selects as
// pick(): see common.h).
struct Sigmoid {
  float s, one_minus_s;
};
inline Sigmoid sigmoid_pair(float a) {
  const float e = exp_approx(-std::fabs(a));
  const float big = 1.f / (1.f + e), small = e * big;
  const bool positive = a >= 0.f;
  return Sigmoid{pick(positive, big, small), pick(positive, small, big)};
}

// trunc = min(sum(counts), rows); a negative count is a data fault (reported before any write).
int rows_to_process(const char *op, const Arg &group_index, int64_t rows, int64_t *trunc) {
  *trunc = rows;
  if (!given(group_index)) return 0;  // (given with no group: the sum is 0)
  const int64_t *counts = group_index.as<int64_t>();
  const int64_t g = group_index.numel();
  int64_t sum = 0;
  for (int64_t i = 0; i < g; ++i) {
    if (counts[i] < 0)
      return fail(op, "group_index[%lld] = %lld is negative (token counts must be >= 0)",
                  (long long)i, (long long)counts[i]);
    // saturates at rows: compared before adding, so counts near INT64_MAX cannot overflow
    sum = counts[i] >= rows - sum ? rows : sum + counts[i];
  }
  *trunc = sum;
  return 0;
}

struct Layout {
  int64_t rows, h;  // x is [rows, 2h]
};

// x [.., 2H] (rank 2 or 3, a float dtype, an even last dimension) and the shape of a tensor
// that is x's with the last dimension `last`.
int check_layout(const char *op, const Arg &x, Layout *l) {
  if (int rc = check_arg(op, "x", x, -1, {DType::kF32, DType::kF16, DType::kBF16})) return rc;
  if ((x.ndim != 2 && x.ndim != 3) || x.dim(-1) % 2 != 0)
    return fail(op, "'x' must be [T, 2H] or [B, S, 2H] with an even last dimension, got %s",
                shape_label(x).c_str());
  l->h = x.dim(-1) / 2;
  l->rows = x.dim(0) * (x.ndim == 3 ? x.dim(1) : 1);
  return 0;
}

// `a` has x's leading dimensions, then `last`, and dtype `dtype`.
int check_rows(const char *op, const char *name, const Arg &a, const Arg &x, int64_t last,
               DType dtype) {
  if (x.ndim == 3) return check_exact(op, name, a, dtype, {x.dim(0), x.dim(1), last});
  return check_exact(op, name, a, dtype, {x.dim(0), last});
}

int check_group_index(const char *op, const Arg &group_index) {
  return given(group_index) ? check_arg(op, "group_index", group_index, 1, {DType::kI64}) : 0;
}

// SwigluGroup: x [.., 2H], weight [.., 1] float32 or none, group_index int64 [G] or none;
// y and y_origin [.., H] of x's dtype.
int check_forward(const Args &args, Layout *l) {
  const char *op = "swiglu_group";
  if (int rc = check_count(op, args, 5)) return rc;
  const Arg x = args[0], weight = args[1], group_index = args[2];
  if (int rc = check_layout(op, x, l)) return rc;
  if (given(weight))
    if (int rc = check_rows(op, "weight", weight, x, 1, DType::kF32)) return rc;
  if (int rc = check_group_index(op, group_index)) return rc;
  if (int rc = check_rows(op, "y", args[3], x, l->h, x.dtype)) return rc;
  return check_rows(op, "y_origin", args[4], x, l->h, x.dtype);
}

// SwigluGroupQuantGrad: grad_y [.., H] and x [.., 2H] of one dtype, weight [.., 1] float32 or
// none (then y_origin [.., H] is required), y_origin or none, group_index int64 [G] or none;
// grad_x like x, grad_weight [.., 1] float32.
int check_backward(const Args &args, Layout *l) {
  const char *op = "swiglu_group_quant_grad";
  if (int rc = check_count(op, args, 7)) return rc;
  const Arg grad_y = args[0], x = args[1], weight = args[2], y_origin = args[3];
  if (int rc = check_layout(op, x, l)) return rc;
  if (int rc = check_rows(op, "grad_y", grad_y, x, l->h, x.dtype)) return rc;
  if (given(weight)) {
    if (int rc = check_rows(op, "weight", weight, x, 1, DType::kF32)) return rc;
    if (!given(y_origin))
      return fail(op, "'weight' needs 'y_origin' to compute the weight's gradient, got none");
  }
  if (given(y_origin))
    if (int rc = check_rows(op, "y_origin", y_origin, x, l->h, x.dtype)) return rc;
  if (int rc = check_group_index(op, args[4])) return rc;
  if (int rc = check_like(op, "grad_x", args[5], x)) return rc;
  return check_rows(op, "grad_weight", args[6], x, 1, DType::kF32);
}

// -- float32 blocks ----------------------------------------------------------------------------
// The maths runs on float32 blocks of at most kBlock elements. float16/bfloat16 blocks are
// converted in separate tight loops (faster than converting inside the maths loop, and GCC 12
// does not vectorise _Float16 conversions at all: F16C instructions do those).

constexpr int64_t kBlock = 512;  // 2 KiB of float32 per stream: stays in L1

template <bool kClamp>
void swiglu_block(const float *x0, const float *x1, int64_t n, float c, float w, float *y,
                  float *y_origin) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    float a = x0[j], b = x1[j];
    if constexpr (kClamp) {
      a = min_of(a, c);
      b = min_of(max_of(b, -c), c);
    }
    const float yo = a * sigmoid_pair(a).s * b;
    y_origin[j] = yo;
    y[j] = yo * w;
  }
}

// grad_x of a block (gy = grad_y * w); returns sum_j grad_y[j] * y_origin[j] (the weight's
// gradient) when kWeight, else 0.
template <bool kClamp, bool kWeight>
float swiglu_grad_block(const float *grad_y, const float *x0, const float *x1,
                        const float *y_origin, int64_t n, float c, float w, float *gx0,
                        float *gx1) {
  float gw = 0.f;
#pragma omp simd reduction(+ : gw)
  for (int64_t j = 0; j < n; ++j) {
    const float a0 = x0[j], b0 = x1[j], g = grad_y[j];
    float a = a0, b = b0;
    if constexpr (kClamp) {
      a = min_of(a, c);
      b = min_of(max_of(b, -c), c);
    }
    const Sigmoid sg = sigmoid_pair(a);
    const float gy = kWeight ? g * w : g;  // (a compile-time choice)
    float da = gy * b * sg.s * (1.f + a * sg.one_minus_s);
    float db = gy * a * sg.s;
    if constexpr (kClamp) {  // gradient passes only strictly inside the clamp (original x)
      da = pick(a0 < c, da, 0.f);
      db = pick((b0 > -c) & (b0 < c), db, 0.f);
    }
    gx0[j] = da;
    gx1[j] = db;
    if constexpr (kWeight) gw += g * y_origin[j];
  }
  return gw;
}

// -- float16/bfloat16 <-> float32 ---------------------------------------------------------------

// -- cache-bypassing stores ----------------------------------------------------------------------

// Outputs at least this large are written with non-temporal stores: they do not fit in the cache
// anyway, and streaming them skips the read-for-ownership of every output line (up to a third of
// this memory-bound kernel's traffic).
constexpr int64_t kStreamBytes = 8 << 20;

inline void stream_copy(void *dst, const void *src, int64_t bytes) {
#if defined(__AVX__)
  char *d = static_cast<char *>(dst);
  const char *s = static_cast<const char *>(src);
  const int64_t head = std::min<int64_t>(bytes, (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31);
  std::memcpy(d, s, head);
  d += head, s += head, bytes -= head;
  for (; bytes >= 32; bytes -= 32, d += 32, s += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i *>(d),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i *>(s)));
  std::memcpy(d, s, bytes);
#else
  std::memcpy(dst, src, bytes);
#endif
}

inline void stream_fence() {
#if defined(__AVX__)
  _mm_sfence();  // streamed stores are weakly ordered: each thread publishes its rows
#endif
}

// -- rows ---------------------------------------------------------------------------------------

// An input block as float32: the tensor itself, or converted into buf.
template <typename T>
inline const float *input(const T *src, float *buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    load_f32(src, buf, n);
    return buf;
  }
}

// Where a block's output is computed: straight into a float32 tensor that is not streamed, else
// into buf (then written by output()).
template <typename T>
inline float *target(T *dst, float *buf, bool stream) {
  if constexpr (std::is_same_v<T, float>) {
    if (!stream) return dst;
  }
  return buf;
}

template <typename T>
inline void output(const float *src, T *dst, int64_t n, bool stream) {
  if constexpr (std::is_same_v<T, float>) {
    if (stream) stream_copy(dst, src, n * static_cast<int64_t>(sizeof(T)));
  } else if (stream) {
    T tmp[kBlock];
    store_f32(src, tmp, n);
    stream_copy(dst, tmp, n * static_cast<int64_t>(sizeof(T)));
  } else {
    store_f32(src, dst, n);
  }
}

// Asks for the two halves' next block while this one is computed and written (the hardware
// prefetcher alone leaves the forward at two thirds of the copy bandwidth: its reads and its
// streamed writes alternate).
template <typename T>
inline void prefetch_next(const T *x, int64_t j, int64_t h) {
  constexpr int64_t kLine = 64 / sizeof(T), kAhead = 4 * kBlock;
  for (int64_t p = j + kAhead; p < j + kAhead + kBlock; p += kLine) {
    __builtin_prefetch(x + p);  // past the row's end: the next row's (prefetches never fault)
    __builtin_prefetch(x + h + p);
  }
}

template <typename T, bool kClamp>
void swiglu_row(const T *x, int64_t h, float c, float w, T *y, T *y_origin, bool stream) {
  float a[kBlock], b[kBlock], fy[kBlock], fyo[kBlock];
  for (int64_t j = 0; j < h; j += kBlock) {
    const int64_t n = std::min(kBlock, h - j);
    prefetch_next(x, j, h);
    float *ty = target(y + j, fy, stream), *tyo = target(y_origin + j, fyo, stream);
    swiglu_block<kClamp>(input(x + j, a, n), input(x + h + j, b, n), n, c, w, ty, tyo);
    if (ty == fy) output(fy, y + j, n, stream);
    if (tyo == fyo) output(fyo, y_origin + j, n, stream);
  }
  if (stream) stream_fence();
}

template <typename T, bool kClamp, bool kWeight>
float swiglu_grad_row(const T *grad_y, const T *x, const T *y_origin, int64_t h, float c, float w,
                      T *gx, bool stream) {
  float g[kBlock], a[kBlock], b[kBlock], yo[kBlock], da[kBlock], db[kBlock];
  float gw = 0.f;
  for (int64_t j = 0; j < h; j += kBlock) {
    const int64_t n = std::min(kBlock, h - j);
    const float *yo_f = kWeight ? input(y_origin + j, yo, n) : nullptr;
    float *tda = target(gx + j, da, stream), *tdb = target(gx + h + j, db, stream);
    gw += swiglu_grad_block<kClamp, kWeight>(input(grad_y + j, g, n), input(x + j, a, n),
                                             input(x + h + j, b, n), yo_f, n, c, w, tda, tdb);
    if (tda == da) output(da, gx + j, n, stream);
    if (tdb == db) output(db, gx + h + j, n, stream);
  }
  if (stream) stream_fence();
  return gw;
}

// -- forward ----------------------------------------------------------------------------------

template <typename T>
int swiglu_forward(const Args &args, Extra *extra) {
  const char *op = "swiglu_group";
  const Arg x = args[0], weight = args[1], group_index = args[2], y = args[3], y_origin = args[4];
  Layout l;
  if (int rc = check_forward(args, &l)) return rc;
  int64_t trunc;
  if (int rc = rows_to_process(op, group_index, l.rows, &trunc)) return rc;
  const float c = extra->GetAttrFloat("clamp_limit");
  const bool clamp = c > 0.f;
  const float *w = weight.present() ? weight.as<float>() : nullptr;
  const int64_t h = l.h;
  const bool stream = 2 * l.rows * h * static_cast<int64_t>(sizeof(T)) >= kStreamBytes;
#pragma omp parallel for schedule(static) if (worth_threads(3 * l.rows * h * (int64_t)sizeof(T)))
  for (int64_t t = 0; t < l.rows; ++t) {
    T *yr = y.as<T>() + t * h, *yo = y_origin.as<T>() + t * h;
    if (t >= trunc) {
      std::fill(yr, yr + h, from_f32<T>(0.f));
      std::fill(yo, yo + h, from_f32<T>(0.f));
      continue;
    }
    const T *xr = x.as<T>() + t * 2 * h;
    const float wt = w ? w[t] : 1.f;
    if (clamp) swiglu_row<T, true>(xr, h, c, wt, yr, yo, stream);
    else swiglu_row<T, false>(xr, h, c, wt, yr, yo, stream);
  }
  return 0;
}

// -- backward ---------------------------------------------------------------------------------

template <typename T>
int swiglu_backward(const Args &args, Extra *extra) {
  const char *op = "swiglu_group_quant_grad";
  const Arg grad_y = args[0], x = args[1], weight = args[2], y_origin = args[3],
            group_index = args[4], grad_x = args[5], grad_weight = args[6];
  Layout l;
  if (int rc = check_backward(args, &l)) return rc;
  const int64_t h = l.h;
  int64_t trunc;
  if (int rc = rows_to_process(op, group_index, l.rows, &trunc)) return rc;
  const float c = extra->GetAttrFloat("clamp_limit");
  const bool clamp = c > 0.f, weighted = weight.present();
  float *gw = grad_weight.present() ? grad_weight.as<float>() : nullptr;
  const bool stream = 2 * l.rows * h * static_cast<int64_t>(sizeof(T)) >= kStreamBytes;
#pragma omp parallel for schedule(static) if (worth_threads(6 * l.rows * h * (int64_t)sizeof(T)))
  for (int64_t t = 0; t < l.rows; ++t) {
    T *gx = grad_x.as<T>() + t * 2 * h;
    float gwt = 0.f;
    if (t < trunc) {
      const T *gy = grad_y.as<T>() + t * h, *xr = x.as<T>() + t * 2 * h;
      if (weighted) {
        const T *yo = y_origin.as<T>() + t * h;
        const float wt = weight.as<float>()[t];
        gwt = clamp ? swiglu_grad_row<T, true, true>(gy, xr, yo, h, c, wt, gx, stream)
                    : swiglu_grad_row<T, false, true>(gy, xr, yo, h, c, wt, gx, stream);
      } else {
        if (clamp) swiglu_grad_row<T, true, false>(gy, xr, nullptr, h, c, 1.f, gx, stream);
        else swiglu_grad_row<T, false, false>(gy, xr, nullptr, h, c, 1.f, gx, stream);
      }
    } else {
      std::fill(gx, gx + 2 * h, from_f32<T>(0.f));
    }
    if (gw) gw[t] = gwt;
  }
  return 0;
}

}  // namespace
}  // namespace MOE_ISA_NS
}  // namespace moe

// inputs: x [.., 2H], weight [.., 1] f32 or None, group_index [G] int64 or None;
// outputs: y [.., H], y_origin [.., H] (un-weighted); attr clamp_limit (> 0: clamp on)
MOE_KERNEL(SwigluGroup)(int nparam, void **params, int *ndims, int64_t **shapes,
                           const char **dtypes, void *stream, void *extra) {
  const Args args{nparam, params, ndims, shapes, dtypes};
  return dispatch_float("swiglu_group", args[0].dtype, [&](auto tag) {
    return swiglu_forward<decltype(tag)>(args, static_cast<Extra *>(extra));
  });
}

// inputs: grad_y [.., H], x [.., 2H], weight [.., 1] f32 or None, y_origin [.., H] or None,
// group_index [G] int64 or None; outputs: grad_x [.., 2H], grad_weight [.., 1] f32 (zeros
// without weight); attr clamp_limit (> 0: clamp on)
MOE_KERNEL(SwigluGroupQuantGrad)(int nparam, void **params, int *ndims, int64_t **shapes,
                                    const char **dtypes, void *stream, void *extra) {
  const Args args{nparam, params, ndims, shapes, dtypes};
  return dispatch_float("swiglu_group_quant_grad", args[1].dtype, [&](auto tag) {
    return swiglu_backward<decltype(tag)>(args, static_cast<Extra *>(extra));
  });
}
