// rms_norm: y = weight * (x * 1/sqrt(mean(x^2) + eps)) over the last axis, float32; add_rms_norm:
// the same of x + residual, the sum written too (a residual connection, then the next norm). As
// MindSpore ops a norm is six kernels (square, mean, add, rsqrt, two products); a decoding step of a 2-layer
// model runs nine norms, and on the CPU each kernel launch costs several microseconds besides its
// work. The sum of squares is taken in double, one row per task (the same bits for any thread
// count); the products are float32 in the composition's order.
#include <cmath>

#include "checks.h"
#include "common.h"

namespace moe {
inline namespace MOE_ISA_NS {
namespace {


// One row: y = weight * (x * 1/sqrt(mean(x^2) + eps)).
inline void norm_row(const float *xr, const float *ws, int64_t h, double eps, float *yr) {
  double squares = 0.0;
  for (int64_t j = 0; j < h; ++j) squares += static_cast<double>(xr[j]) * xr[j];
  const float scale = static_cast<float>(1.0 / std::sqrt(squares / h + eps));
  for (int64_t j = 0; j < h; ++j) yr[j] = ws[j] * (xr[j] * scale);
}

// rms_norm (residual null) or add_rms_norm: the rows of x (+ residual, written to sum) normalised.
int norm_rows(const char *op, const Args &args, Extra *extra, bool add) {
  if (int rc = check_count(op, args, add ? 5 : 3)) return rc;
  const Arg x = args[0], r = args[1], w = args[add ? 2 : 1], y = args[add ? 3 : 2], sum = args[4];
  if (int rc = check_arg(op, "x", x, -1, {DType::kF32})) return rc;
  if (x.ndim < 1) return fail(op, "'x' must have at least one axis, got a scalar");
  if (add) {
    if (int rc = check_like(op, "residual", r, x)) return rc;
    if (int rc = check_like(op, "sum", sum, x)) return rc;
  }
  const int64_t h = x.dim(-1);
  if (int rc = check_exact(op, "weight", w, DType::kF32, {h})) return rc;
  if (int rc = check_like(op, "y", y, x)) return rc;
  const double eps = extra->GetAttrFloat("eps");
  if (!(eps >= 0.0)) return fail(op, "attribute 'eps' must be >= 0, got %g", eps);
  const int64_t rows = h == 0 ? 0 : x.numel() / h;
  const float *xs = x.as<float>(), *rs = add ? r.as<float>() : nullptr, *ws = w.as<float>();
  float *ys = y.as<float>(), *sums = add ? sum.as<float>() : nullptr;
#pragma omp parallel for schedule(static) if (worth_threads(rows * h * (add ? 16 : 8)))
  for (int64_t row = 0; row < rows; ++row) {
    const float *xr = xs + row * h;
    if (add) {
      float *sr = sums + row * h;
      const float *rr = rs + row * h;
      for (int64_t j = 0; j < h; ++j) sr[j] = xr[j] + rr[j];
      xr = sr;
    }
    norm_row(xr, ws, h, eps, ys + row * h);
  }
  return 0;
}

}  // namespace
}  // namespace MOE_ISA_NS
}  // namespace moe

// inputs: x float32 [..., H], weight float32 [H]; output y float32 [..., H]; attr eps (float).
MOE_KERNEL(RmsNorm)(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                    void *stream, void *extra) {
  return moe::norm_rows("rms_norm", Args{nparam, params, ndims, shapes, dtypes},
                        static_cast<moe::Extra *>(extra), false);
}

// inputs: x, residual float32 [..., H], weight float32 [H]; outputs y, sum (x + residual) float32
// [..., H]; attr eps (float).
MOE_KERNEL(AddRmsNorm)(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                       void *stream, void *extra) {
  return moe::norm_rows("add_rms_norm", Args{nparam, params, ndims, shapes, dtypes},
                        static_cast<moe::Extra *>(extra), true);
}
