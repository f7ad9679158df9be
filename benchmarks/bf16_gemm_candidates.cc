// The bfloat16 GEMM candidates side by side, one thread each, at the MoE layer's product shapes
// (benchmarks/bench_bf16_gemm.py builds and runs this): OpenBLAS sgemm on the same values in
// float32 (the package's float32 path), oneDNN's dnnl_gemm_bf16bf16f32 and dnnl_sgemm (the
// libdnnl given, e.g. MindSpore's), MKL's cblas_gemm_bf16bf16f32 and its packed-B form (when a
// libmkl_rt is given), and a hand-written AVX512-BF16 micro-kernel with GotoBLAS-style blocking
// (below: 12x32 register tile of vdpbf16ps, packed A and B panels). Prints GFLOP/s and each
// result's largest error against the float32 sgemm of the same bfloat16 values.
//
//   bf16_gemm_candidates LIBDNNL [LIBMKL_RT]
#include <dlfcn.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include <cblas.h>

namespace bf16dot {
constexpr int MR = 12, NR = 32;
constexpr int64_t KC = 256, MC = 192, NC = 512;
#define BF16DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// B block [kc x nc] -> panels of NR columns: [kc2][NR][2] u16 each (zeros past the edges)
BF16DOT_TARGET inline void pack_b(const uint16_t *b, bool trans, int64_t ldb, int64_t k0, int64_t kc,
                                  int64_t j0, int64_t nc, uint16_t *out) {
  const int64_t kc2 = (kc + 1) / 2;
  const __m512i lo_idx = _mm512_set_epi16(47,15,46,14,45,13,44,12,43,11,42,10,41,9,40,8,39,7,38,6,37,5,36,4,35,3,34,2,33,1,32,0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t p = 0; p * NR < nc; ++p) {
    uint16_t *o = out + p * kc2 * NR * 2;
    const int64_t jn = std::min<int64_t>(NR, nc - p * NR), j = j0 + p * NR;
    if (!trans) {
      const __mmask32 m = jn >= 32 ? ~0u : ((1u << jn) - 1);
      for (int64_t kp = 0; kp < kc2; ++kp) {
        const int64_t k = k0 + 2 * kp;
        const __m512i r0 = _mm512_maskz_loadu_epi16(m, b + k * ldb + j);
        const __m512i r1 = 2 * kp + 1 < kc ? _mm512_maskz_loadu_epi16(m, b + (k + 1) * ldb + j) : _mm512_setzero_si512();
        _mm512_storeu_si512(o + kp * 64, _mm512_permutex2var_epi16(r0, lo_idx, r1));
        _mm512_storeu_si512(o + kp * 64 + 32, _mm512_permutex2var_epi16(r0, hi_idx, r1));
      }
    } else {  // element (k, j) at b[j * ldb + k]: pairs along k are contiguous
      uint32_t *o32 = reinterpret_cast<uint32_t *>(o);
      for (int64_t jj = 0; jj < NR; ++jj) {
        const uint16_t *col = b + (j + jj) * ldb + k0;
        for (int64_t kp = 0; kp < kc2; ++kp) {
          uint32_t v = 0;
          if (jj < jn) {
            v = col[2 * kp];
            if (2 * kp + 1 < kc) v |= uint32_t(col[2 * kp + 1]) << 16;
          }
          o32[kp * NR + jj] = v;
        }
      }
    }
  }
}

// A block [mc x kc] -> panels of MR rows: [kc2][MR] u32 (pairs along k; zeros past the edges)
inline void pack_a(const uint16_t *a, bool trans, int64_t lda, int64_t i0, int64_t mc, int64_t k0,
                   int64_t kc, uint32_t *out) {
  const int64_t kc2 = (kc + 1) / 2;
  for (int64_t p = 0; p * MR < mc; ++p) {
    uint32_t *o = out + p * kc2 * MR;
    const int64_t rn = std::min<int64_t>(MR, mc - p * MR), i = i0 + p * MR;
    for (int64_t r = 0; r < MR; ++r)
      for (int64_t kp = 0; kp < kc2; ++kp) {
        uint32_t v = 0;
        if (r < rn) {
          const int64_t k = k0 + 2 * kp;
          const uint16_t x0 = trans ? a[k * lda + i + r] : a[(i + r) * lda + k];
          const uint16_t x1 = 2 * kp + 1 < kc ? (trans ? a[(k + 1) * lda + i + r] : a[(i + r) * lda + k + 1]) : 0;
          v = x0 | (uint32_t(x1) << 16);
        }
        o[kp * MR + r] = v;
      }
  }
}

BF16DOT_TARGET inline void micro(int64_t kc2, const uint32_t *ap, const uint16_t *bp, float *c,
                                 int64_t ldc, int mr, int nr, bool add) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kc2; ++kp) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + kp * 64);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + kp * 64 + 32);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(ap[kp * MR + r]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
    }
  }
  const __mmask16 m0 = nr >= 16 ? 0xffff : (1u << nr) - 1;
  const __mmask16 m1 = nr >= 32 ? 0xffff : nr <= 16 ? 0 : (1u << (nr - 16)) - 1;
  for (int r = 0; r < mr; ++r) {
    float *cr = c + r * ldc;
    __m512 v0 = acc[r][0], v1 = acc[r][1];
    if (add) {
      v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, cr), v0);
      v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, cr + 16), v1);
    }
    _mm512_mask_storeu_ps(cr, m0, v0);
    _mm512_mask_storeu_ps(cr + 16, m1, v1);
  }
}

// beta is 0 or 1
BF16DOT_TARGET inline void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const uint16_t *a,
                                int64_t lda, const uint16_t *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  thread_local std::vector<uint16_t> bbuf;
  thread_local std::vector<uint32_t> abuf;
  if (k == 0) { if (beta == 0.f) for (int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, 4 * n); return; }
  for (int64_t j0 = 0; j0 < n; j0 += NC) {
    const int64_t nc = std::min(NC, n - j0), npan = (nc + NR - 1) / NR;
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
      const int64_t kc = std::min(KC, k - k0), kc2 = (kc + 1) / 2;
      bbuf.resize(npan * kc2 * NR * 2);
      pack_b(b, tb, ldb, k0, kc, j0, nc, bbuf.data());
      const bool add = k0 > 0 || beta != 0.f;
      for (int64_t i0 = 0; i0 < m; i0 += MC) {
        const int64_t mc = std::min(MC, m - i0), mpan = (mc + MR - 1) / MR;
        abuf.resize(mpan * kc2 * MR);
        pack_a(a, ta, lda, i0, mc, k0, kc, abuf.data());
        for (int64_t jp = 0; jp < npan; ++jp)
          for (int64_t ip = 0; ip < mpan; ++ip)
            micro(kc2, abuf.data() + ip * kc2 * MR, bbuf.data() + jp * kc2 * NR * 2,
                  c + (i0 + ip * MR) * ldc + j0 + jp * NR, ldc,
                  (int)std::min<int64_t>(MR, mc - ip * MR), (int)std::min<int64_t>(NR, nc - jp * NR), add);
      }
    }
  }
}
}  // namespace bf16dot

namespace {

using GemmBf16 = int(char, char, int64_t, int64_t, int64_t, float, const uint16_t *, int64_t,
                     const uint16_t *, int64_t, float, float *, int64_t);
using Sgemm = int(char, char, int64_t, int64_t, int64_t, float, const float *, int64_t,
                  const float *, int64_t, float, float *, int64_t);
// MKL's CBLAS (mkl_cblas.h), by value: layout 101 row-major, 111/112 no/transpose, 162 the B
// matrix, 151 packed
using MklGemm = void(int, int, int, int, int, int, float, const uint16_t *, int, const uint16_t *,
                     int, float, float *, int);
using MklPackSize = size_t(int, int, int, int);
using MklPack = void(int, int, int, int, int, int, const uint16_t *, int, uint16_t *);
using MklSetLayer = int(int);

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class F>
double best_of(F f, int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s LIBDNNL [LIBMKL_RT]\n", argv[0]);
    return 2;
  }
  void *dnnl = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!dnnl) {
    std::fprintf(stderr, "%s\n", dlerror());
    return 1;
  }
  auto *dnnl_bf16 = reinterpret_cast<GemmBf16 *>(dlsym(dnnl, "dnnl_gemm_bf16bf16f32"));
  auto *dnnl_sgemm = reinterpret_cast<Sgemm *>(dlsym(dnnl, "dnnl_sgemm"));
  void *mkl = argc > 2 ? dlopen(argv[2], RTLD_NOW | RTLD_LOCAL) : nullptr;
  MklGemm *mkl_gemm = nullptr, *mkl_compute = nullptr;
  MklPackSize *mkl_pack_size = nullptr;
  MklPack *mkl_pack = nullptr;
  if (mkl) {
    reinterpret_cast<MklSetLayer *>(dlsym(mkl, "MKL_Set_Threading_Layer"))(1);  // sequential
    mkl_gemm = reinterpret_cast<MklGemm *>(dlsym(mkl, "cblas_gemm_bf16bf16f32"));
    mkl_compute = reinterpret_cast<MklGemm *>(dlsym(mkl, "cblas_gemm_bf16bf16f32_compute"));
    mkl_pack_size = reinterpret_cast<MklPackSize *>(dlsym(mkl, "cblas_gemm_bf16bf16f32_pack_get_size"));
    mkl_pack = reinterpret_cast<MklPack *>(dlsym(mkl, "cblas_gemm_bf16bf16f32_pack"));
  } else if (argc > 2) {
    std::fprintf(stderr, "MKL not loaded: %s\n", dlerror());
  }
  scipy_openblas_set_num_threads(1);
  struct Shape {
    int m, k, n;
    bool ta, tb;
    const char *what;
  } shapes[] = {{512, 512, 512, false, false, "x @ W1 (512-row tile)"},
                {512, 256, 512, false, false, "a @ W2"},
                {512, 512, 512, false, true, "dh @ W1^T"},
                {512, 512, 256, false, true, "dy @ W2^T"},
                {512, 1024, 512, true, false, "x^T @ dh (dW1)"},
                {256, 1024, 512, true, false, "a^T @ dy (dW2)"},
                {64, 512, 512, false, false, "x @ W1, 64 rows"}};
  std::mt19937 gen(0);
  std::normal_distribution<float> normal;
  std::printf("GFLOP/s, one thread, best of 3 x 20 calls in turns\n");
  std::printf("%-22s %5s %5s %5s | %8s %8s %8s %8s %8s %8s | max error / max |C|: own, oneDNN, MKL\n",
              "product", "M", "K", "N", "OpenBLAS", "1DNN f32", "own bf16", "1DNN bf16", "MKL bf16",
              "MKL pack");
  for (const Shape &s : shapes) {
    const int m = s.m, k = s.k, n = s.n, lda = s.ta ? m : k, ldb = s.tb ? k : n;
    std::vector<float> af(size_t(m) * k), bf(size_t(k) * n), ref(size_t(m) * n), c(size_t(m) * n);
    std::vector<uint16_t> ab(af.size()), bb(bf.size());
    for (size_t i = 0; i < af.size(); ++i) af[i] = from_bf16(ab[i] = to_bf16(normal(gen)));
    for (size_t i = 0; i < bf.size(); ++i) bf[i] = from_bf16(bb[i] = to_bf16(normal(gen)));
    const char ta = s.ta ? 'T' : 'N', tb = s.tb ? 'T' : 'N';
    auto openblas = [&] {
      scipy_cblas_sgemm(CblasRowMajor, s.ta ? CblasTrans : CblasNoTrans, s.tb ? CblasTrans : CblasNoTrans,
                        m, n, k, 1.f, af.data(), lda, bf.data(), ldb, 0.f, ref.data(), n);
    };
    openblas();
    auto err = [&] {
      double e = 0, big = 0;
      for (size_t i = 0; i < c.size(); ++i) {
        e = std::max(e, double(std::fabs(c[i] - ref[i])));
        big = std::max(big, double(std::fabs(ref[i])));
      }
      return e / big;
    };
    double e_own = 0, e_dnnl = 0, e_mkl = 0;
    auto own = [&] { bf16dot::gemm(s.ta, s.tb, m, n, k, ab.data(), lda, bb.data(), ldb, 0.f, c.data(), n); };
    own();
    e_own = err();
    auto d_bf16 = [&] { dnnl_bf16(ta, tb, m, n, k, 1.f, ab.data(), lda, bb.data(), ldb, 0.f, c.data(), n); };
    d_bf16();
    e_dnnl = err();
    auto d_f32 = [&] { dnnl_sgemm(ta, tb, m, n, k, 1.f, af.data(), lda, bf.data(), ldb, 0.f, c.data(), n); };
    std::vector<uint16_t> packed;
    auto m_bf16 = [&] { mkl_gemm(101, s.ta ? 112 : 111, s.tb ? 112 : 111, m, n, k, 1.f, ab.data(), lda, bb.data(), ldb, 0.f, c.data(), n); };
    auto m_pack = [&] { mkl_compute(101, s.ta ? 112 : 111, 151, m, n, k, 1.f, ab.data(), lda, packed.data(), ldb, 0.f, c.data(), n); };
    if (mkl_gemm) {
      m_bf16();
      e_mkl = err();
      packed.resize(mkl_pack_size(162, m, n, k) / 2 + 1);
      mkl_pack(101, 162, s.tb ? 112 : 111, m, n, k, bb.data(), ldb, packed.data());
    }
    double t[6];
    std::fill(t, t + 6, 1e30);
    for (int round = 0; round < 3; ++round) {
      t[0] = std::min(t[0], best_of(openblas, 20));
      t[1] = std::min(t[1], best_of(d_f32, 20));
      t[2] = std::min(t[2], best_of(own, 20));
      t[3] = std::min(t[3], best_of(d_bf16, 20));
      if (mkl_gemm) {
        t[4] = std::min(t[4], best_of(m_bf16, 20));
        t[5] = std::min(t[5], best_of(m_pack, 20));
      }
    }
    const double flops = 2.0 * m * n * k;
    std::printf("%-22s %5d %5d %5d |", s.what, m, k, n);
    for (int i = 0; i < 6; ++i) {
      if (t[i] < 1e30) std::printf(" %8.1f", flops / t[i] / 1e9);
      else std::printf(" %8s", "-");
    }
    std::printf(" | %.1e %.1e %.1e\n", e_own, e_dnnl, e_mkl);
  }
  return 0;
}
