// decode_attention: one new position of grouped-query attention over a KV cache, float32: the
// rotary embedding (halves paired) of the query and key, the key and value written at the cache
// slot, softmax(q k^T * scaling + mask) v over the whole cache. As MindSpore ops this is 15
// kernels a layer (rotations, two scatters, the scores, scaling, mask, softmax, the weighted
// sum), each launch costing the CPU runtime several microseconds besides its work; the kernel
// is one. One task per (sequence, key head): it copies that head's cache rows, writes the new
// row and serves the head's query heads, reading each cached key and value once for all of them.
// Sums go in a fixed order (lane-wise, then the lanes in a fixed tree): the same bits for any
// thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "checks.h"
#include "common.h"

namespace moe {
inline namespace MOE_ISA_NS {
namespace {

constexpr const char *kOp = "decode_attention";
constexpr int kLanes = 16;
constexpr int kMaxGroup = 64;  // query heads per key head served by one pass over the cache

// x rotated: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] of the halves x1, x2.
inline void rotate_half(const float *x, const float *cos, const float *sin, int64_t d, float *out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i] * cos[i], b = -x[i + half] * sin[i];
    out[i] = a + b;
  }
  for (int64_t i = half; i < d; ++i) {
    const float a = x[i] * cos[i], b = x[i - half] * sin[i];
    out[i] = a + b;
  }
}

// sum_i a[i] * b[i], lane-wise then the lanes pairwise.
inline float dot(const float *a, const float *b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) lanes[l] += a[i] * b[i];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

struct Dims {
  int64_t batch, heads, kv_heads, length, d;
};

// Sequence b's key head g: its cache rows copied with the new row at slot, then its query heads.
void serve(const Dims &n, int64_t b, int64_t g, int64_t slot, float scaling, const float *q,
           const float *k, const float *v, const float *cos, const float *sin, const float *kc,
           const float *vc, const float *mask, float *out, float *kc_out, float *vc_out,
           std::vector<float> &scores, std::vector<float> &rotated) {
  const int64_t d = n.d, length = n.length, group = n.heads / n.kv_heads;
  const int64_t head = (b * n.kv_heads + g) * length * d;
  const float *cos_b = cos + b * d, *sin_b = sin + b * d, *mask_b = mask + b * length;
  float *keys = kc_out + head, *values = vc_out + head;
  std::memcpy(keys, kc + head, sizeof(float) * length * d);
  std::memcpy(values, vc + head, sizeof(float) * length * d);
  const int64_t row = (b * n.kv_heads + g) * d;
  rotate_half(k + row, cos_b, sin_b, d, keys + slot * d);
  std::memcpy(values + slot * d, v + row, sizeof(float) * d);

  for (int64_t h0 = 0; h0 < group; h0 += kMaxGroup) {
    const int64_t hs = std::min<int64_t>(kMaxGroup, group - h0);
    rotated.resize(hs * d);
    for (int64_t h = 0; h < hs; ++h)
      rotate_half(q + ((b * n.heads) + g * group + h0 + h) * d, cos_b, sin_b, d, &rotated[h * d]);
    scores.assign(hs * length, 0.0f);
    for (int64_t j = 0; j < length; ++j) {
      const float *key = keys + j * d;
      for (int64_t h = 0; h < hs; ++h)
        scores[h * length + j] = dot(&rotated[h * d], key, d) * scaling + mask_b[j];
    }
    for (int64_t h = 0; h < hs; ++h) {
      float *s = &scores[h * length];
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < length; ++j) top = std::max(top, s[j]);
      float total = 0.0f;
      for (int64_t j = 0; j < length; ++j) {
        s[j] = std::exp(s[j] - top);
        total += s[j];
      }
      const float inv = 1.0f / total;
      float *o = out + ((b * n.heads) + g * group + h0 + h) * d;
      for (int64_t i = 0; i < d; ++i) o[i] = 0.0f;
      for (int64_t j = 0; j < length; ++j) {
        const float p = s[j] * inv;
        const float *value = values + j * d;
        for (int64_t i = 0; i < d; ++i) o[i] += p * value[i];
      }
    }
  }
}

int decode_attention(const Args &args, Extra *extra) {
  if (int rc = check_count(kOp, args, 12)) return rc;
  const Arg q = args[0], k = args[1], v = args[2], cos = args[3], sin = args[4], kc = args[5],
            vc = args[6], mask = args[7], slot = args[8], out = args[9], kc_out = args[10],
            vc_out = args[11];
  if (int rc = check_arg(kOp, "query", q, 4, {DType::kF32})) return rc;
  if (int rc = check_arg(kOp, "key_cache", kc, 4, {DType::kF32})) return rc;
  const Dims n{q.dim(0), q.dim(1), kc.dim(1), kc.dim(2), q.dim(3)};
  if (q.dim(2) != 1) return fail(kOp, "'query' must be [B, heads, 1, D] (one position), got %s", shape_label(q).c_str());
  if (int rc = check_exact(kOp, "key", k, DType::kF32, {n.batch, n.kv_heads, 1, n.d})) return rc;
  if (int rc = check_exact(kOp, "value", v, DType::kF32, {n.batch, n.kv_heads, 1, n.d})) return rc;
  if (int rc = check_exact(kOp, "cos", cos, DType::kF32, {n.batch, 1, 1, n.d})) return rc;
  if (int rc = check_exact(kOp, "sin", sin, DType::kF32, {n.batch, 1, 1, n.d})) return rc;
  if (int rc = check_exact(kOp, "key_cache", kc, DType::kF32, {n.batch, n.kv_heads, n.length, n.d})) return rc;
  if (int rc = check_like(kOp, "value_cache", vc, kc)) return rc;
  if (int rc = check_exact(kOp, "mask", mask, DType::kF32, {n.batch, 1, 1, n.length})) return rc;
  if (int rc = check_arg(kOp, "slot", slot, 0, {DType::kI32})) return rc;
  if (int rc = check_like(kOp, "out", out, q)) return rc;
  if (int rc = check_like(kOp, "key_cache_out", kc_out, kc)) return rc;
  if (int rc = check_like(kOp, "value_cache_out", vc_out, kc)) return rc;
  if (n.kv_heads == 0 || n.heads % n.kv_heads != 0)
    return fail(kOp, "the query heads (%lld) must be a multiple of the key heads (%lld)",
                static_cast<long long>(n.heads), static_cast<long long>(n.kv_heads));
  if (n.d % 2 != 0) return fail(kOp, "the head size must be even (rotary halves), got %lld", static_cast<long long>(n.d));
  const float scaling = extra->GetAttrFloat("scaling");
  const int64_t at = n.batch == 0 ? 0 : *slot.as<int32_t>();
  if (n.batch > 0 && (at < 0 || at >= n.length))
    return fail(kOp, "'slot' %lld is outside the cache's %lld positions", static_cast<long long>(at),
                static_cast<long long>(n.length));
  if (n.d == 0) return 0;  // every tensor empty
  const int64_t tasks = n.batch * n.kv_heads;
  const int64_t bytes = 3 * 2 * tasks * n.length * n.d * 4;  // two caches read, written, read
  const float *qs = q.as<float>(), *ks = k.as<float>(), *vs = v.as<float>(),
              *cs = cos.as<float>(), *ss = sin.as<float>(), *kcs = kc.as<float>(),
              *vcs = vc.as<float>(), *ms = mask.as<float>();
  float *os = out.as<float>(), *kco = kc_out.as<float>(), *vco = vc_out.as<float>();
#pragma omp parallel if (worth_threads(bytes))
  {
    std::vector<float> scores, rotated;  // (each thread's, reused by its tasks)
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t)
      serve(n, t / n.kv_heads, t % n.kv_heads, at, scaling, qs, ks, vs, cs, ss, kcs, vcs, ms, os,
            kco, vco, scores, rotated);
  }
  return 0;
}

}  // namespace
}  // namespace MOE_ISA_NS
}  // namespace moe

// inputs: query [B, N, 1, D], key and value [B, Nkv, 1, D], cos and sin [B, 1, 1, D], key_cache
// and value_cache [B, Nkv, L, D], mask [B, 1, 1, L] (added to the scores), all float32, slot int32
// []; outputs: out [B, N, 1, D], key_cache_out, value_cache_out; attr scaling (float).
MOE_KERNEL(DecodeAttention)(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  return moe::decode_attention(Args{nparam, params, ndims, shapes, dtypes}, static_cast<moe::Extra *>(extra));
}
