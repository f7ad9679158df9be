// Shared by the MoeFFN kernels (float path in ffn.cc, int8 path in ffn_int8.cc): expert row
// ranges and activations.
#pragma once

#include <cstring>
#include <string>
#include <vector>

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

// Row offsets of each group from a counts tensor `name` (int64 [G]): counts (each >= 0, sum <= m)
// or, with cumulative, inclusive ends (non-decreasing, last <= m). offsets gets G + 1 entries;
// rows from offsets[G] to m belong to no group (a padded batch: the caller zeroes them with
// zero_tail_rows). Returns non-zero (after one line on stderr) when the counts do not fit m rows.
inline int group_offsets(const char *op, const char *name, const Arg &tokens, bool cumulative,
                         int64_t m, std::vector<int64_t> &offsets) {
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
  return 0;
}

// Zeroes rows [from, m) of a row-major [m, n] output: the rows past the last group.
template <typename T>
void zero_tail_rows(T *out, int64_t from, int64_t m, int64_t n) {
  if (from < m) std::memset(static_cast<void *>(out + from * n), 0, sizeof(T) * (m - from) * n);
}

// The same for MoeFFN's expert_tokens.
inline int expert_offsets(const char *op, const Arg &tokens, bool cumulative, int64_t m,
                          std::vector<int64_t> &offsets) {
  return group_offsets(op, "expert_tokens", tokens, cumulative, m, offsets);
}

// The int8 path of MoeFFN (ffn_int8.cc); same arguments as the MoeFFN entry point.
int moe_ffn_int8(const Args &args, Extra *extra);

}  // namespace MOE_ISA_NS
}  // namespace moe
