// The compile-time check of an aclnn binding against the aclnn header in the include path
// (ms_moe_ops/ops/_extension.py generates one MOE_CHECK_PROTOTYPE per binding): the first
// stage's parameter types, outputs, workspace size and executor included, compared up to const.
// Light on purpose: the tests compile it against the stub CANN tree alone, in a second.
#pragma once
#include <type_traits>

namespace moe_ext {
// Compile-time check of a binding against the aclnn header in the include path: the first
// stage's parameters, outputs, workspace size and executor included, up to const.
template <typename T>
struct Bare {
  using type = std::remove_const_t<T>;
};
template <typename T>
struct Bare<const T *> {
  using type = T *;
};
template <typename T>
struct Bare<T *const> {
  using type = typename Bare<T *>::type;
};
template <typename... A>
struct Params {};
template <typename F>
struct ParamsOf;
template <typename R, typename... A>
struct ParamsOf<R (*)(A...)> {
  using type = Params<typename Bare<A>::type...>;
};
#define MOE_CHECK_PROTOTYPE(api, ...)                                                               \
  static_assert(std::is_same_v<typename moe_ext::ParamsOf<decltype(&api##GetWorkspaceSize)>::type, \
                               moe_ext::Params<__VA_ARGS__>>,                                     \
                "ms_moe_ops: the installed header of " #api " does not declare the arguments this binding passes")

}  // namespace moe_ext
