// cast: float32/float16/bfloat16 to float32/float16/bfloat16, element by element, rounded to
// nearest-even (NaN stays NaN): the Cells' own dtype changes under mixed precision. MindSpore's CPU
// Cast of bfloat16 takes 3 to 14 ns per element (2.10); this runs at memory speed, in blocks
// shared between the threads (each element converted alone: the same bits for any thread count).
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "checks.h"
#include "common.h"

namespace moe {
inline namespace MOE_ISA_NS {
namespace {

constexpr const char *kOp = "cast";
constexpr int64_t kBlock = 4096;  // elements per task (its float32 buffer stays in L1)

template <typename S, typename D>
void convert(const S *src, D *dst, int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (blocks > 16)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i = b * kBlock, len = std::min(kBlock, n - i);
    if constexpr (std::is_same_v<S, D>) {
      std::memcpy(dst + i, src + i, sizeof(S) * len);
    } else if constexpr (std::is_same_v<S, float>) {
      store_f32(src + i, dst + i, len);
    } else if constexpr (std::is_same_v<D, float>) {
      load_f32(src + i, dst + i, len);
    } else {  // float16 <-> bfloat16 through float32 (exact, then one rounding)
      float buf[kBlock];
      load_f32(src + i, buf, len);
      store_f32(buf, dst + i, len);
    }
  }
}

int cast(const Args &args) {
  if (int rc = check_count(kOp, args, 2)) return rc;
  const Arg x = args[0], y = args[1];
  const auto floats = {DType::kF32, DType::kF16, DType::kBF16};
  if (int rc = check_arg(kOp, "x", x, -1, floats)) return rc;
  if (int rc = check_arg(kOp, "y", y, x.ndim, floats)) return rc;
  for (int i = 0; i < x.ndim; ++i)
    if (y.shape[i] != x.shape[i])
      return fail(kOp, "'y' must have shape %s, got %s", shape_label(x).c_str(), shape_label(y).c_str());
  const int64_t n = x.numel();
  return dispatch_float(kOp, x.dtype, [&](auto from) {
    return dispatch_float(kOp, y.dtype, [&](auto to) {
      using S = decltype(from);
      using D = decltype(to);
      convert(x.as<S>(), y.as<D>(), n);
      return 0;
    });
  });
}

}  // namespace
}  // namespace MOE_ISA_NS
}  // namespace moe

// inputs: x (float32, float16 or bfloat16, any shape); output y, x's shape, the dtype asked for.
MOE_KERNEL(Cast)(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                    void *stream, void *extra) {
  return cast(Args{nparam, params, ndims, shapes, dtypes});
}
