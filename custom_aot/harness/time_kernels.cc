// Times the same kernel calls on several kernel libraries or instruction-set paths, in turns
// within one process (so load changes on a shared machine hit every contender alike), at the
// README's benchmark shapes. For comparing builds; the benchmarks/ scripts compare against other
// implementations.
//
//   time_kernels [--rounds N] [--only WORD] [--csv FILE] LABEL=LIBRARY[:PATH][,NAME=VALUE...] ...
//   time_kernels old=../main/ms_moe_ops/_kernels.so new=ms_moe_ops/_kernels.so
//                new-avx2=ms_moe_ops/_kernels.so:avx2
//   time_kernels onednn=ms_moe_ops/_kernels.so,MS_MOE_OPS_ONEDNN=.../libdnnl.so.3
//                blas=ms_moe_ops/_kernels.so,MS_MOE_OPS_ONEDNN=0
//
// PATH sets MS_MOE_OPS_ISA for that contender's calls, NAME=VALUE other variables; --only keeps the cases whose name holds
// WORD. Prints each case's median time per contender and its ratio to the first contender;
// --csv also writes "case,contender,median_ms" rows (benchmarks/bench_isa.py reads them).
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>

#include "aot_call.h"

namespace {

using harness::Attrs;
using harness::Tensor;
using harness::from_values;
using harness::zeros;

struct Contender {
  std::string label, path;
  std::vector<std::pair<std::string, std::string>> env;
  std::unique_ptr<harness::Library> lib;
};

struct Case {
  std::string name, kernel;
  std::vector<Tensor> tensors;  // inputs then outputs
  Attrs attrs;
};

Tensor none;

Tensor random(harness::Rng &rng, const std::string &dtype, std::vector<int64_t> shape, double scale = 1.0) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return from_values(dtype, std::move(shape), rng.values(n, scale));
}

std::vector<Case> cases() {
  std::vector<Case> out;
  harness::Rng rng(1);
  auto add = [&](std::string name, std::string kernel, std::vector<Tensor> t) {
    out.push_back(Case{std::move(name), std::move(kernel), std::move(t), Attrs()});
    return &out.back().attrs;
  };
  for (const char *dt : {"float32", "bfloat16"}) {  // SwiGLU, T=8192, H=2048
    const int64_t t = 8192, h = 2048;
    Tensor x = random(rng, dt, {t, 2 * h}, 4.0);
    add(std::string("swiglu forward ") + dt, "SwigluGroup",
        {x, none, none, zeros(dt, {t, h}), zeros(dt, {t, h})})->set_float("clamp_limit", 0.f);
    add(std::string("swiglu backward ") + dt, "SwigluGroupQuantGrad",
        {random(rng, dt, {t, h}), x, none, none, none, zeros(dt, {t, 2 * h}), zeros("float32", {t, 1})})
        ->set_float("clamp_limit", 0.f);
  }
  {  // router, M=16384, N=256, K=8, 8 groups, top 4
    const int64_t m = 16384, n = 256, k = 8;
    Attrs *a = add("router forward", "MoeGatingTopK",
                   {random(rng, "float32", {m, n}, 3.0), random(rng, "float32", {n}, 0.1),
                    zeros("float32", {m, k}), zeros("int32", {m, k}), zeros("float32", {m, n})});
    a->set_int("k", k).set_int("k_group", 4).set_int("group_count", 8).set_int("group_select_mode", 1);
    a->set_int("renorm", 0).set_int("norm_type", 1).set_float("routed_scaling_factor", 2.5f).set_float("eps", 1e-20f);
    std::vector<double> idx(m * k);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t p = 0; p < k; ++p) idx[i * k + p] = static_cast<double>((i * 7 + p * 31) % n);
    add("router backward", "MoeGatingTopKBackward",
        {random(rng, "float32", {m, n}), random(rng, "float32", {m, k}), from_values("int32", {m, k}, idx),
         zeros("float32", {m, n})})
        ->set_float("routed_scaling_factor", 2.5f).set_float("eps", 1e-20f);
  }
  // MoeFFN float32 and int8 (fastgelu, even split), at the README's shape and at the int8
  // benchmark's (benchmarks/bench_ffn_int8.py --m 1024 --h 512 --f 1024 --e 8)
  for (const auto &shape : {std::vector<int64_t>{4096, 1024, 2048, 8}, std::vector<int64_t>{1024, 512, 1024, 8}}) {
    const int64_t m = shape[0], h = shape[1], f = shape[2], e = shape[3];
    const std::string size = " M=" + std::to_string(m);
    Tensor tokens = from_values("int64", {e}, std::vector<double>(e, m / e));
    add("moe_ffn float32" + size, "MoeFFN",
        {random(rng, "float32", {m, h}), tokens, random(rng, "float32", {e, h, f}, 0.05), none,
         random(rng, "float32", {e, f, h}, 0.05), none, none, none, none, none, zeros("float32", {m, h})})
        ->set_str("activation", "fastgelu").set_bool("tokens_index_flag", false);
    auto ints = [&](std::vector<int64_t> shape, int64_t lo) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      std::vector<double> v(n);
      for (double &x : v) x = static_cast<double>(rng.integer(lo, 127));
      return from_values("int8", shape, v);
    };
    // weights in [-127, 127] as the package quantises them (symmetric); the same with weights
    // over all of int8 (-128 too: the avx2 path's slower product) at the smaller shape
    for (const int64_t lo : {-127, -128}) {
      if (lo == -128 && m > 1024) continue;
      add(lo == -127 ? "moe_ffn int8" + size : "moe_ffn int8 -128 weights" + size, "MoeFFN",
          {ints({m, h}, -128), tokens, ints({e, h, f}, lo), none, ints({e, f, h}, lo), none,
           from_values("float32", {e}, std::vector<double>(e, 0.05)), none,
           from_values("float32", {e, f}, std::vector<double>(e * f, 1.0 / 65536)),
           from_values("float32", {e, h}, std::vector<double>(e * h, 1.0 / 65536)), zeros("float32", {m, h})})
          ->set_str("activation", "fastgelu").set_bool("tokens_index_flag", false);
    }
  }
  // grouped_matmul at the MoE layer's shape (bench_layer.py: T*K = 16384 rows, 16 experts,
  // H = 2F = 512): the forward product and the weight gradient's
  for (const char *dt : {"float32", "bfloat16"}) {
    const int64_t m = 16384, k = 512, n = 512, g = 16;
    Tensor counts = from_values("int64", {g}, std::vector<double>(g, m / g));
    add(std::string("grouped_matmul ") + dt, "GroupedMatmul",
        {random(rng, dt, {m, k}), random(rng, dt, {g, k, n}, 0.05), counts, none, zeros(dt, {m, n})})
        ->set_bool("transpose_x", false).set_bool("transpose_weight", false).set_bool("cumulative", false);
    add(std::string("grouped_matmul dW ") + dt, "GroupedMatmul",
        {random(rng, dt, {m, k}), random(rng, dt, {m, n}), counts, none, zeros(dt, {g, k, n})})
        ->set_bool("transpose_x", true).set_bool("transpose_weight", false).set_bool("cumulative", false);
  }
  // decoding's products (benchmarks/bench_generate.py, hidden 1024): a projection of 1 or 8 rows
  // (weight [N, K] as nn.Linear holds it, one group), and the experts' first product with one
  // row in each of 2 or 16 experts
  for (const int64_t m : {1, 8}) {
    const std::string rows = " M=" + std::to_string(m);
    for (const int64_t n : {256, 1024, 8192})
      add("decode projection N=" + std::to_string(n) + rows, "GroupedMatmul",
          {random(rng, "float32", {m, 1024}), random(rng, "float32", {n, 1024}, 0.05),
           from_values("int64", {1}, {double(m)}), none, zeros("float32", {m, n})})
          ->set_bool("transpose_x", false).set_bool("transpose_weight", true).set_bool("cumulative", false);
    const int64_t g = m == 1 ? 2 : 16;
    add("decode experts G=" + std::to_string(g) + " M=" + std::to_string(g), "GroupedMatmul",
        {random(rng, "float32", {g, 1024}), random(rng, "float32", {16, 1024, 1024}, 0.05),
         from_values("int64", {16}, [&] { std::vector<double> c(16, 0.0); for (int64_t i = 0; i < g; ++i) c[i * 16 / g] = 1; return c; }()),
         none, zeros("float32", {g, 1024})})
        ->set_bool("transpose_x", false).set_bool("transpose_weight", false).set_bool("cumulative", false);
  }
  // a shared expert's first product at one row: one group of a [K, N] weight (cut along K)
  add("decode shared expert M=1", "GroupedMatmul",
      {random(rng, "float32", {1, 1024}), random(rng, "float32", {1, 1024, 2048}, 0.05),
       from_values("int64", {1}, {1.0}), none, zeros("float32", {1, 2048})})
      ->set_bool("transpose_x", false).set_bool("transpose_weight", false).set_bool("cumulative", false);
  // a decoding step's attention: 16 query heads and 4 key heads of 64
  for (const auto &[b, l] : std::vector<std::pair<int64_t, int64_t>>{{1, 64}, {1, 1024}, {8, 64}}) {
    add("decode attention B=" + std::to_string(b) + " L=" + std::to_string(l), "DecodeAttention",
        {random(rng, "float32", {b, 16, 1, 64}), random(rng, "float32", {b, 4, 1, 64}),
         random(rng, "float32", {b, 4, 1, 64}), random(rng, "float32", {b, 1, 1, 64}),
         random(rng, "float32", {b, 1, 1, 64}), random(rng, "float32", {b, 4, l, 64}),
         random(rng, "float32", {b, 4, l, 64}), zeros("float32", {b, 1, 1, l}),
         from_values("int32", {}, {double(l / 2)}), zeros("float32", {b, 16, 1, 64}),
         zeros("float32", {b, 4, l, 64}), zeros("float32", {b, 4, l, 64})})
        ->set_float("scaling", 0.125f);
  }
  {  // MoeFFN's activation backward, M=4096, F=2048
    const int64_t m = 4096, f = 2048;
    add("activation grad float32", "MoeFFNActivationGrad",
        {random(rng, "float32", {m, f}, 4.0), random(rng, "float32", {m, f}), zeros("float32", {m, f}),
         zeros("float32", {m, f})})
        ->set_str("activation", "fastgelu");
  }
  {  // token permutation, T=8192, H=2048, K=8, E=64
    const int64_t t = 8192, h = 2048, k = 8, e = 64;
    std::vector<double> idx(t * k);
    for (double &v : idx) v = static_cast<double>(rng.integer(0, e - 1));
    Tensor x = random(rng, "float32", {t, h}), ei = from_values("int32", {t, k}, idx);
    Tensor permuted = zeros("float32", {t * k, h}), sorted = zeros("int32", {t * k}), counts = zeros("int64", {e});
    Attrs a;
    a.set_int("num_experts", e).set_int("top_k", k);
    out.push_back(Case{"permute", "MoeTokenPermute", {x, ei, permuted, sorted, counts}, a});
    // sorted_index for the unpermute: any permutation of the rows works
    std::vector<double> perm(t * k);
    for (int64_t i = 0; i < t * k; ++i) perm[i] = static_cast<double>((i * 7919) % (t * k));
    add("unpermute weighted", "MoeTokenUnpermute",
        {zeros("float32", {t * k, h}), from_values("int32", {t * k}, perm), random(rng, "float32", {t, k}),
         zeros("float32", {t, h})})
        ->set_int("top_k", k);
  }
  return out;
}

double seconds(harness::Library &lib, Case &c) {
  std::vector<Tensor *> args;
  for (Tensor &t : c.tensors) args.push_back(&t);
  const auto start = std::chrono::steady_clock::now();
  if (int rc = lib.call(c.kernel, args, c.attrs)) {
    std::fprintf(stderr, "time_kernels: %s returned %d\n", c.name.c_str(), rc);
    std::exit(1);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char **argv) {
  int rounds = 7;
  std::string only;
  FILE *csv = nullptr;
  std::vector<Contender> contenders;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--rounds" && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
      continue;
    }
    if (arg == "--only" && i + 1 < argc) {
      only = argv[++i];
      continue;
    }
    if (arg == "--csv" && i + 1 < argc) {
      csv = std::fopen(argv[++i], "w");
      if (!csv) return 2;
      std::fprintf(csv, "case,contender,median_ms\n");
      continue;
    }
    const size_t eq = arg.find('=');
    if (eq == std::string::npos) {
      std::fprintf(stderr, "usage: %s [--rounds N] [--only WORD] [--csv FILE] LABEL=LIBRARY[:PATH][,NAME=VALUE...] ...\n", argv[0]);
      return 2;
    }
    // ",NAME=VALUE" settings after the library (and path)
    std::vector<std::pair<std::string, std::string>> env;
    std::string spec = arg.substr(eq + 1);
    for (size_t comma; (comma = spec.rfind(',')) != std::string::npos;) {
      const std::string setting = spec.substr(comma + 1);
      const size_t e = setting.find('=');
      if (e == std::string::npos) break;
      env.emplace_back(setting.substr(0, e), setting.substr(e + 1));
      spec = spec.substr(0, comma);
    }
    const size_t colon = spec.rfind(':');
    const bool has_path = colon != std::string::npos;
    const std::string file = spec.substr(0, has_path ? colon : std::string::npos);
    contenders.push_back({arg.substr(0, eq), has_path ? spec.substr(colon + 1) : "", env,
                          std::make_unique<harness::Library>(file)});
  }
  if (contenders.empty()) return 2;
  std::printf("%-26s", "case (median ms)");
  for (auto &c : contenders) std::printf(" %14s", c.label.c_str());
  std::printf("   (ratio: time / %s's)\n", contenders[0].label.c_str());
  for (Case &c : cases()) {
    if (c.name.find(only) == std::string::npos) continue;
    std::vector<std::vector<double>> times(contenders.size());
    for (int r = -1; r < rounds; ++r)  // round -1 warms up
      for (size_t i = 0; i < contenders.size(); ++i) {
        if (contenders[i].path.empty()) unsetenv("MS_MOE_OPS_ISA");
        else setenv("MS_MOE_OPS_ISA", contenders[i].path.c_str(), 1);
        for (auto &other : contenders)  // (a variable another contender sets is unset here)
          for (auto &setting : other.env) unsetenv(setting.first.c_str());
        for (auto &[name, value] : contenders[i].env) setenv(name.c_str(), value.c_str(), 1);
        const double s = seconds(*contenders[i].lib, c);
        if (r >= 0) times[i].push_back(s);
      }
    std::vector<double> med;
    for (auto &t : times) {
      std::sort(t.begin(), t.end());
      med.push_back(t[t.size() / 2] * 1e3);
    }
    std::printf("%-26s", c.name.c_str());
    for (size_t i = 0; i < med.size(); ++i) {
      std::printf(" %8.2f %5.2fx", med[i], med[i] / med[0]);
      if (csv) std::fprintf(csv, "%s,%s,%.4f\n", c.name.c_str(), contenders[i].label.c_str(), med[i]);
    }
    std::printf("\n");
    std::fflush(stdout);
    if (csv) std::fflush(csv);
  }
  if (csv) std::fclose(csv);
  return 0;
}
