// Shared by the MoeFFN kernels (float path in ffn.cc, int8 path in ffn_int8.cc): expert row
// ranges and activations.
#pragma once

#include <cstring>
#include <string>
#include <vector>

#include "checks.h"
#include "common.h"

namespace moe {
inline namespace MOE_ISA_NS {

enum class Activation { kFastGelu, kGelu, kRelu, kSilu, kUnknown };

inline Activation parse_activation(const std::string &name) {
  if (name == "fastgelu") return Activation::kFastGelu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "relu") return Activation::kRelu;
  if (name == "silu") return Activation::kSilu;
  return Activation::kUnknown;
}

inline float activate(Activation act, float x) {
  switch (act) {
    case Activation::kFastGelu: return x * sigmoid(1.702f * x);
    case Activation::kGelu: return x * sigmoid(1.59576912f * (x + 0.044715f * x * x * x));
    case Activation::kRelu: return x > 0.f ? x : 0.f;
    case Activation::kSilu: return x * sigmoid(x);
    default: return x;
  }
}

// Row offsets of each group from a counts tensor `name` (int64 [G]): counts (each >= 0) or, with
// cumulative, inclusive ends (non-decreasing). The groups cover exactly m rows, or with padded at
// most m: rows from offsets[G] to m then belong to no group (a padded batch: the caller zeroes
// them with zero_tail_rows). offsets gets G + 1 entries. Returns non-zero (after one line on
// stderr) when the counts do not fit.
inline int group_offsets(const char *op, const char *name, const Arg &tokens, bool cumulative,
                         bool padded, int64_t m, std::vector<int64_t> &offsets) {
  const int64_t e = tokens.numel();
  const int64_t *t = tokens.as<int64_t>();
  offsets.assign(e + 1, 0);
  for (int64_t i = 0; i < e; ++i) {
    // compared before adding, so a huge count cannot overflow
    const bool fits = cumulative ? (t[i] >= offsets[i] && t[i] <= m)
                                 : (t[i] >= 0 && t[i] <= m - offsets[i]);
    if (!fits)
      return fail(op, "%s[%lld] = %lld does not fit %lld rows (%s)", name, (long long)i,
                  (long long)t[i], (long long)m,
                  cumulative ? "cumulative ends must be non-decreasing and <= M"
                             : "counts must be >= 0 and add up to at most M");
    offsets[i + 1] = cumulative ? t[i] : offsets[i] + t[i];
  }
  if (!padded && offsets[e] != m)
    return fail(op, "%s cover %lld of the %lld rows of x; they must cover all of them (%s), or "
                "the call must allow a padded batch", name, (long long)offsets[e], (long long)m,
                cumulative ? "last cumulative end == M" : "counts add up to M");
  return 0;
}

// The `padded` attribute (rows past the last group allowed), or `otherwise` for a primitive built
// without it.
inline bool padded_attr(Extra *extra, bool otherwise) {
  return extra->HasAttr("padded") ? extra->GetAttrBool("padded") : otherwise;
}

// Zeroes rows [from, m) of a row-major [m, n] output: the rows past the last group.
template <typename T>
void zero_tail_rows(T *out, int64_t from, int64_t m, int64_t n) {
  if (from < m && n > 0) std::memset(static_cast<void *>(out + from * n), 0, sizeof(T) * (m - from) * n);
}

// The same for MoeFFN's expert_tokens: they cover every row unless the call allows a padded
// batch (SPEC §4).
inline int expert_offsets(const char *op, const Arg &tokens, Extra *extra, int64_t m,
                          std::vector<int64_t> &offsets) {
  return group_offsets(op, "expert_tokens", tokens, extra->GetAttrBool("tokens_index_flag"),
                       padded_attr(extra, false), m, offsets);
}

constexpr int64_t kMaxFfnExperts = 256;

// The activation attribute, known, or a failure.
inline int check_activation(const char *op, Extra *extra, Activation *act) {
  *act = parse_activation(extra->GetAttrStr("activation"));
  return *act == Activation::kUnknown ? fail(op, "unknown activation '%s'",
                                             extra->GetAttrStr("activation").c_str())
                                      : 0;
}

// The int8 path of MoeFFN (ffn_int8.cc); same arguments as the MoeFFN entry point.
int moe_ffn_int8(const Args &args, Extra *extra);

}  // namespace MOE_ISA_NS
}  // namespace moe
