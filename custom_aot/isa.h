// Instruction-set paths chosen at run time.
//
// setup.py compiles every kernel source once per path, each with its own -march, into its own
// namespace moe::isa_<path> (MOE_ISA names the path; every name of the kernels lives in that
// inline namespace, so the copies never mix). The baseline compile (no MOE_ISA given: the
// generic path) also defines the exported entry points, which call the best path this CPU has,
// or the one MS_MOE_OPS_ISA names (custom_aot/dispatch/isa.cc). On x86-64 the paths are
// generic (any x86-64), avx2 (x86-64-v3), avxvnni (x86-64-v3 with AVX-VNNI) and avx512
// (x86-64-v4 with AVX-512 VNNI); on aarch64 generic (ARMv8-A, NEON) and dotprod (with the
// SDOT/UDOT instructions of ARMv8.2's dot product extension); elsewhere generic.
#pragma once

#include <cstdint>

#ifndef MOE_ISA
#define MOE_ISA generic
#define MOE_ENTRY_POINTS 1
#endif

#define MOE_CAT_(a, b) a##b
#define MOE_CAT(a, b) MOE_CAT_(a, b)
#define MOE_ISA_NS MOE_CAT(isa_, MOE_ISA)

// Functions exported from the library: defined by the baseline compile only (a path compile
// keeps its copy private, so each symbol is defined once). A Windows DLL exports what is marked
// dllexport (and then nothing else); ELF and Mach-O what has default visibility (the library is
// built with -fvisibility=hidden).
#if defined(MOE_ENTRY_POINTS) && defined(_WIN32)
#define MOE_EXPORT extern "C" __declspec(dllexport)
#elif defined(MOE_ENTRY_POINTS)
#define MOE_EXPORT extern "C" __attribute__((visibility("default")))
#else
#define MOE_EXPORT [[maybe_unused]] static
#endif

namespace moe {

// MindSpore's CPU AOT kernel signature.
using KernelFn = int(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                     void *stream, void *extra);

namespace dispatch {
// Index of the path a kernel call takes now (its place in MOE_PATH_LIST), or -1 after one line
// on stderr when MS_MOE_OPS_ISA names an unknown path or one this CPU or build lacks.
int path();
// The failure message of the last kernel call on this thread (fail() records it), and the
// exception the exported entry points throw with it: MindSpore catches a std::exception from an
// AOT kernel and raises a RuntimeError carrying its message, in PyNative and GRAPH mode alike.
void record_error(const char *message);
[[noreturn]] void throw_error();
}  // namespace dispatch

}  // namespace moe

// The paths of the target, lowest first: X(path, arg) for each (setup.py compiles the same list).
#if defined(MOE_X86_PATHS)
#define MOE_PATH_LIST(X, arg) X(generic, arg) X(avx2, arg) X(avxvnni, arg) X(avx512, arg)
#elif defined(MOE_ARM_PATHS)
#define MOE_PATH_LIST(X, arg) X(generic, arg) X(dotprod, arg)
#else
#define MOE_PATH_LIST(X, arg) X(generic, arg)
#endif
#define MOE_PATH_NAME(path, arg) #path,
#define MOE_PATH_ENTRY(path, name) &moe::isa_##path::name,
// (the baseline's own namespace is the inline one in its compile)
#define MOE_INLINE_generic inline
#define MOE_INLINE_avx2
#define MOE_INLINE_avxvnni
#define MOE_INLINE_avx512
#define MOE_INLINE_dotprod
#define MOE_PATH_DECLARE(path, name) MOE_CAT(MOE_INLINE_, path) namespace isa_##path { KernelFn name; }
#define MOE_DECLARE_PATHS(name) namespace moe { MOE_PATH_LIST(MOE_PATH_DECLARE, name) }

// Defines a kernel entry point, written as
//   MOE_KERNEL(Name)(int nparam, void **params, int *ndims, int64_t **shapes,
//                    const char **dtypes, void *stream, void *extra) { ... }
// The body becomes moe::isa_<path>::Name; the baseline compile adds the exported `Name` that
// calls the chosen path's copy. A body returns non-zero after fail() (nothing written); the
// exported function then throws std::runtime_error with fail()'s message.
#if defined(MOE_ENTRY_POINTS)
#define MOE_KERNEL(name)                                                                     \
  MOE_DECLARE_PATHS(name)                                                                    \
  MOE_EXPORT int name(int nparam, void **params, int *ndims, int64_t **shapes,               \
                      const char **dtypes, void *stream, void *extra) {                      \
    static moe::KernelFn *const paths[] = {MOE_PATH_LIST(MOE_PATH_ENTRY, name)};                                 \
    const int p = moe::dispatch::path();                                                     \
    if (p < 0 || paths[p](nparam, params, ndims, shapes, dtypes, stream, extra) != 0)        \
      moe::dispatch::throw_error();                                                          \
    return 0;                                                                                \
  }                                                                                          \
  int moe::isa_generic::name
#else
#define MOE_KERNEL(name)                                                                     \
  namespace moe { inline namespace MOE_ISA_NS { KernelFn name; } }                            \
  int moe::MOE_ISA_NS::name
#endif
