// dequantize: y[g, k, n] = float(weight[index[g], k, n]) * scale[index[g], n], the float32 weights
// of quantised experts (int8 per output channel) for the experts a call needs. MindSpore's CPU
// ops took 1.4 ns per element for it (gather, cast, tile of the scale, multiply: 8 ms of a
// 12 ms decoding step at hidden 1024); this reads each int8 weight once and writes its float32.
// Each element is one product, so the result is the same for any thread count.
#include "checks.h"
#include "common.h"

namespace moe {
inline namespace MOE_ISA_NS {
namespace {

constexpr const char *kOp = "dequantize";

int dequantize(const Args &args) {
  if (int rc = check_count(kOp, args, 4)) return rc;
  const Arg w = args[0], scale = args[1], index = args[2], y = args[3];
  if (int rc = check_arg(kOp, "weight", w, 3, {DType::kI8})) return rc;
  const int64_t e = w.dim(0), k = w.dim(1), n = w.dim(2);
  if (int rc = check_exact(kOp, "scale", scale, DType::kF32, {e, n})) return rc;
  if (int rc = check_arg(kOp, "index", index, 1, {DType::kI32})) return rc;
  const int64_t g = index.dim(0);
  if (int rc = check_exact(kOp, "y", y, DType::kF32, {g, k, n})) return rc;
  const int32_t *idx = index.as<int32_t>();
  for (int64_t i = 0; i < g; ++i)
    if (idx[i] < 0 || idx[i] >= e)
      return fail(kOp, "'index' must hold expert numbers in [0, %lld), got %d at position %lld",
                  (long long)e, idx[i], (long long)i);
  if (g * k * n == 0) return 0;
  const int8_t *ws = w.as<int8_t>();
  const float *ss = scale.as<float>();
  float *ys = y.as<float>();
  const int64_t rows = g * k;
#pragma omp parallel for schedule(static) if (worth_threads(rows * n * 5))
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t expert = idx[r / k];
    const int8_t *src = ws + (expert * k + r % k) * n;
    const float *s = ss + expert * n;
    float *dst = ys + r * n;
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]) * s[j];
  }
  return 0;
}

}  // namespace
}  // namespace MOE_ISA_NS
}  // namespace moe

// inputs: weight int8 [E, K, N], scale float32 [E, N], index int32 [G]; output y float32 [G, K, N].
MOE_KERNEL(Dequantize)(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                       void *stream, void *extra) {
  return dequantize(Args{nparam, params, ndims, shapes, dtypes});
}
