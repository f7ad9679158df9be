// oneDNN's BLAS-like products (dnnl_sgemm, dnnl_gemm_bf16bf16f32), found at run time in the
// process (dispatch/onednn.cc): MindSpore loads its own libdnnl.so.3 when it is imported, so the
// package adds no dependency and builds without oneDNN. Row-major, like the BLAS calls in gemm.h;
// each call runs on the calling thread (MindSpore's build has the threadpool runtime, which is
// sequential without a threadpool), so the kernels' tiles keep their one OpenMP pool.
//
// MS_MOE_OPS_ONEDNN (read at every call): unset or empty, the oneDNN already in the process;
// "0", never (the BLAS and the float32 conversions of the kernels, as before); a path, that
// libdnnl (loaded on first use; the harness and other C++ callers have no MindSpore).
#pragma once

#include <cstdint>

namespace moe {
namespace onednn {

using Sgemm = int(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha,
                  const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                  int64_t ldc);
using GemmBf16 = int(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha,
                     const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, float beta,
                     float *c, int64_t ldc);

// The products oneDNN runs at its native rate on this CPU, or null: sgemm when oneDNN runs
// AVX-512 kernels (avx512_core), gemm_bf16 when it runs bfloat16 dot products (avx512_core_bf16:
// vdpbf16ps, or AMX). Null also when MS_MOE_OPS_ONEDNN=0 or no oneDNN is found.
Sgemm *sgemm();
GemmBf16 *gemm_bf16();

// One line saying what was found: "oneDNN 3.10.1 (libdnnl.so.3 in the process), CPU ISA
// avx512_core_bf16", or why none is used.
const char *about();

}  // namespace onednn
}  // namespace moe
