// MoeFFN (SPEC §4): y[rows e] = act(x[rows e] @ W1[e] + b1[e]) @ W2[e] + b2[e] for every expert e.
// The float path lives here (the int8 path in ffn_int8.cc); the activation's backward too.
// A block of one expert's rows goes through both BLAS products in one thread (gemm.h's tiles),
// bias1 and the activation in one pass over the hidden block, bias2 added as the output is
// written.
#include <algorithm>

#include "ffn.h"
#include "gemm.h"

namespace moe {
inline namespace MOE_ISA_NS {
namespace {

constexpr const char *kOp = "moe_ffn";
template <typename B, typename Fn>
void bias_act_rows(float *h, int64_t rows, int64_t f, const B *bias, Fn fn) {
  for (int64_t i = 0; i < rows; ++i) {
    float *r = h + i * f;
    if (bias)
      for (int64_t j = 0; j < f; ++j) r[j] = fn(r[j] + to_f32(bias[j]));
    else
      for (int64_t j = 0; j < f; ++j) r[j] = fn(r[j]);
  }
}

// h = act(h + bias) in place (bias may be null); the switch is outside the loop.
template <typename B>
void bias_activate(float *h, int64_t rows, int64_t f, const B *bias, Activation act) {
  switch (act) {
    case Activation::kFastGelu:
      return bias_act_rows(h, rows, f, bias, [](float v) { return activate(Activation::kFastGelu, v); });
    case Activation::kGelu:
      return bias_act_rows(h, rows, f, bias, [](float v) { return activate(Activation::kGelu, v); });
    case Activation::kRelu:
      return bias_act_rows(h, rows, f, bias, [](float v) { return activate(Activation::kRelu, v); });
    default:
      return bias_act_rows(h, rows, f, bias, [](float v) { return activate(Activation::kSilu, v); });
  }
}

// The float path's arguments (SPEC §4): x [M, H], expert_tokens int64 [E] (1 <= E <= 256),
// weight1 [E, H, F], bias1 [E, F] or none, weight2 [E, F, H], bias2 [E, H] or none, all float
// tensors of x's dtype, no quantisation argument; y [M, H] of x's dtype; every size within the
// BLAS's int.
int check_float_path(const Args &args, Extra *extra, Activation *act) {
  if (int rc = check_count(kOp, args, 11)) return rc;
  const Arg x = args[0], tokens = args[1], w1 = args[2];
  if (int rc = check_arg(kOp, "x", x, 2, {DType::kF32, DType::kF16, DType::kBF16})) return rc;
  if (int rc = check_arg(kOp, "expert_tokens", tokens, 1, {DType::kI64})) return rc;
  if (int rc = check_arg(kOp, "weight1", w1, 3, {x.dtype})) return rc;
  const int64_t m = x.dim(0), h = x.dim(1), e = tokens.dim(0), f = w1.dim(2);
  if (e < 1 || e > kMaxFfnExperts)
    return fail(kOp, "the expert count E (expert_tokens.shape[0]) must be in [1, %lld], got %lld",
                (long long)kMaxFfnExperts, (long long)e);
  if (int rc = check_exact(kOp, "weight1", w1, x.dtype, {e, h, f})) return rc;
  if (int rc = check_optional(kOp, "bias1", args[3], x.dtype, {e, f})) return rc;
  if (int rc = check_exact(kOp, "weight2", args[4], x.dtype, {e, f, h})) return rc;
  if (int rc = check_optional(kOp, "bias2", args[5], x.dtype, {e, h})) return rc;
  const char *const quant[] = {"scale", "offset", "deq_scale1", "deq_scale2"};
  for (int i = 0; i < 4; ++i)
    if (int rc = check_absent(kOp, quant[i], args[6 + i], "a quantisation argument of the int8 path"))
      return rc;
  if (int rc = check_exact(kOp, "y", args[10], x.dtype, {m, h})) return rc;
  if (!blas_sizes_ok({m, h, f})) return fail(kOp, "a dimension exceeds the BLAS limit of %d", INT_MAX);
  return check_activation(kOp, extra, act);
}

template <typename T>
int moe_ffn_float(const Args &args, Extra *extra) {
  const Arg x = args[0], tokens = args[1], w1 = args[2], b1 = args[3], w2 = args[4],
            b2 = args[5], y = args[10];
  Activation act;
  if (int rc = check_float_path(args, extra, &act)) return rc;
  const int64_t m = x.dim(0), h = x.dim(1), e = w1.dim(0), f = w1.dim(2);
  std::vector<int64_t> off;
  if (int rc = expert_offsets(kOp, tokens, extra, m, off)) return rc;

  const T *xs = x.as<T>(), *w1s = w1.as<T>(), *w2s = w2.as<T>();
  const T *b1s = b1.present() ? b1.as<T>() : nullptr, *b2s = b2.present() ? b2.as<T>() : nullptr;
  T *ys = y.as<T>();
  // a tile is a block of one expert's rows through both products: the hidden block stays in the
  // thread's cache
  // bfloat16 x and weight1 go to the dot-product GEMM as they are, where the path has one; the
  // hidden layer stays float32 (SPEC), so the second product is a float32 one
  onednn::GemmBf16 *const dot = std::is_same_v<T, bf16> ? bf16_dot() : nullptr;
  for_each_tile(row_tiles(off, 1), [&](const Tile &t) {
    thread_local std::vector<float> w1buf, w2buf, xbuf, hidden, ybuf;
    const float *w2f = as_f32(w2s + t.g * f * h, f, h, h, w2buf);
    const T *b1e = b1s ? b1s + t.g * f : nullptr, *b2e = b2s ? b2s + t.g * h : nullptr;
    hidden.resize(t.r * f);
    if constexpr (std::is_same_v<T, bf16>) {
      if (dot)
        gemm_bf16(dot, false, false, t.r, f, h, xs + t.r0 * h, h, w1s + t.g * h * f, f, 0.f,
                  hidden.data(), f);
    }
    if (!dot) {
      const float *w1f = as_f32(w1s + t.g * h * f, h, f, f, w1buf);
      const float *xf = as_f32(xs + t.r0 * h, t.r, h, h, xbuf);
      sgemm(false, false, t.r, f, h, xf, h, w1f, f, 0.f, hidden.data(), f);
    }
    bias_activate(hidden.data(), t.r, f, b1e, act);
    T *yr = ys + t.r0 * h;
    if constexpr (std::is_same_v<T, float>) {
      if (b2e) fill_rows(yr, t.r, h, b2e, h);  // bias first, the BLAS adds the product
      sgemm(false, false, t.r, h, f, hidden.data(), f, w2f, h, b2e ? 1.f : 0.f, yr, h);
    } else {
      ybuf.resize(t.r * h);
      sgemm(false, false, t.r, h, f, hidden.data(), f, w2f, h, 0.f, ybuf.data(), h);
      store_rows(ybuf.data(), t.r, h, b2e, yr, h);
    }
  });
  zero_tail_rows(ys, off[e], m, h);
  return 0;
}

// grad_h = grad_a * act'(h) and a = act(h), elementwise in one pass.
template <typename T, typename Fn>
void act_grad_loop(const T *hs, const T *gas, T *ghs, T *as, int64_t n, Fn fn) {
#pragma omp parallel for schedule(static) if (worth_threads(4 * n * (int64_t)sizeof(T)))
  for (int64_t i = 0; i < n; ++i) {
    float a, d;
    fn(to_f32(hs[i]), a, d);
    ghs[i] = from_f32<T>(to_f32(gas[i]) * d);
    as[i] = from_f32<T>(a);
  }
}

template <typename T>
int activation_grad(const Args &args, Extra *extra) {
  const char *op = "moe_ffn_activation_grad";
  if (int rc = check_count(op, args, 4)) return rc;
  const Arg hv = args[0], ga = args[1], gh = args[2], av = args[3];
  if (int rc = check_arg(op, "h", hv, -1, {DType::kF32, DType::kF16, DType::kBF16})) return rc;
  if (int rc = check_like(op, "grad_a", ga, hv)) return rc;
  if (int rc = check_like(op, "grad_h", gh, hv)) return rc;
  if (int rc = check_like(op, "a", av, hv)) return rc;
  Activation act;
  if (int rc = check_activation(op, extra, &act)) return rc;
  const int64_t n = hv.numel();
  const T *hs = hv.as<T>(), *gas = ga.as<T>();
  T *ghs = gh.as<T>(), *as = av.as<T>();
  // a = v s(u v) style activations: a' = s + v s (1 - s) u'
  switch (act) {
    case Activation::kFastGelu:
      act_grad_loop(hs, gas, ghs, as, n, [](float v, float &a, float &d) {
        const float s = sigmoid(1.702f * v);
        a = v * s;
        d = s + 1.702f * v * s * (1.f - s);
      });
      return 0;
    case Activation::kGelu:
      act_grad_loop(hs, gas, ghs, as, n, [](float v, float &a, float &d) {
        constexpr float c = 1.59576912f, k = 0.044715f;
        const float s = sigmoid(c * (v + k * v * v * v));
        a = v * s;
        d = s + v * s * (1.f - s) * c * (1.f + 3.f * k * v * v);
      });
      return 0;
    case Activation::kRelu:
      act_grad_loop(hs, gas, ghs, as, n, [](float v, float &a, float &d) {
        a = v > 0.f ? v : 0.f;
        d = v > 0.f ? 1.f : 0.f;
      });
      return 0;
    case Activation::kSilu:
      act_grad_loop(hs, gas, ghs, as, n, [](float v, float &a, float &d) {
        const float s = sigmoid(v);
        a = v * s;
        d = s + v * s * (1.f - s);
      });
      return 0;
    default:
      return fail("moe_ffn_activation_grad", "unknown activation");
  }
}

}  // namespace
}  // namespace MOE_ISA_NS
}  // namespace moe

// inputs (aclnnMoeFFN order): x [M, H], expert_tokens int64 [E], weight1 [E, H, F], bias1 [E, F],
// weight2 [E, F, H], bias2 [E, H], scale, offset, deq_scale1, deq_scale2; output y [M, H].
MOE_KERNEL(MoeFFN)(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                      void *stream, void *extra_ptr) {
  const Args args{nparam, params, ndims, shapes, dtypes};
  auto *extra = static_cast<Extra *>(extra_ptr);
  if (args.n > 0 && args.dtypes && args[0].dtype == DType::kI8) return moe_ffn_int8(args, extra);
  return dispatch_float(kOp, args[0].dtype, [&](auto tag) {
    return moe_ffn_float<decltype(tag)>(args, extra);
  });
}

// inputs: h (pre-activation), grad_a (gradient of act(h)); outputs: grad_h, act(h).
MOE_KERNEL(MoeFFNActivationGrad)(int nparam, void **params, int *ndims, int64_t **shapes,
                                    const char **dtypes, void *stream, void *extra) {
  const Args args{nparam, params, ndims, shapes, dtypes};
  return dispatch_float("moe_ffn_activation_grad", args[0].dtype, [&](auto tag) {
    return activation_grad<decltype(tag)>(args, static_cast<Extra *>(extra));
  });
}
