// rms_norm: y = weight * (x * 1/sqrt(mean(x^2) + eps)) over the last axis, float32. As MindSpore
// ops a norm is six kernels (square, mean, add, rsqrt, two products); a decoding step of a 2-layer
// model runs nine norms, and on the CPU each kernel launch costs several microseconds besides its
// work. The sum of squares is taken in double, one row per task (the same bits for any thread
// count); the products are float32 in the composition's order.
#include <cmath>

#include "checks.h"
#include "common.h"

namespace moe {
inline namespace MOE_ISA_NS {
namespace {

constexpr const char *kOp = "rms_norm";

int rms_norm(const Args &args, Extra *extra) {
  if (int rc = check_count(kOp, args, 3)) return rc;
  const Arg x = args[0], w = args[1], y = args[2];
  if (int rc = check_arg(kOp, "x", x, -1, {DType::kF32})) return rc;
  if (x.ndim < 1) return fail(kOp, "'x' must have at least one axis, got a scalar");
  const int64_t h = x.dim(-1);
  if (int rc = check_exact(kOp, "weight", w, DType::kF32, {h})) return rc;
  if (int rc = check_like(kOp, "y", y, x)) return rc;
  const double eps = extra->GetAttrFloat("eps");
  if (!(eps >= 0.0)) return fail(kOp, "attribute 'eps' must be >= 0, got %g", eps);
  const int64_t rows = h == 0 ? 0 : x.numel() / h;
  const float *xs = x.as<float>(), *ws = w.as<float>();
  float *ys = y.as<float>();
#pragma omp parallel for schedule(static) if (worth_threads(rows * h * 8))
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = xs + r * h;
    float *yr = ys + r * h;
    double squares = 0.0;
    for (int64_t j = 0; j < h; ++j) squares += static_cast<double>(xr[j]) * xr[j];
    const float scale = static_cast<float>(1.0 / std::sqrt(squares / h + eps));
    for (int64_t j = 0; j < h; ++j) yr[j] = ws[j] * (xr[j] * scale);
  }
  return 0;
}

}  // namespace
}  // namespace MOE_ISA_NS
}  // namespace moe

// inputs: x float32 [..., H], weight float32 [H]; output y float32 [..., H]; attr eps (float).
MOE_KERNEL(RmsNorm)(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                    void *stream, void *extra) {
  return moe::rms_norm(Args{nparam, params, ndims, shapes, dtypes}, static_cast<moe::Extra *>(extra));
}
