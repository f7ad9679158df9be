"""The functional wrappers (ms_moe_ops.ops.moe_gating_top_k, ...) restate their operator's
attributes as keyword parameters: every one must have the declaration's default, and every
attribute must be reachable (or derived from the inputs), so the two cannot drift apart."""
import inspect

import pytest

from ms_moe_ops import ops as functional
from ms_moe_ops.ops import gating, permute

WRAPPERS = {
    "moe_gating_top_k": functional.GATING_TOP_K,
    "moe_gating_top_k_backward": functional.GATING_BACKWARD,
    "moe_gating_top_k_grad": functional.GATING_GRAD,
    "swiglu_group": functional.SWIGLU_GROUP,
    "swiglu_group_quant_grad": functional.SWIGLU_GROUP_QUANT_GRAD,
    "moe_ffn": functional.MOE_FFN,
    "grouped_matmul": functional.GROUPED_MATMUL,
    "moe_token_permute": functional.PERMUTE,
    "moe_token_unpermute": functional.UNPERMUTE,
    "moe_token_unpermute_backward": functional.UNPERMUTE_BACKWARD,
}
# attributes a wrapper derives from its inputs rather than taking them
DERIVED = {("moe_token_unpermute", "with_probs"), ("moe_token_unpermute_backward", "with_probs")}
# a wrapper's None for an attribute whose declared default means "none" (an empty string)
_NONE_MEANS = {"": None}


def _wrapper(name):
    module = {"moe_gating_top_k_grad": gating,
              "moe_token_unpermute_backward": permute}.get(name, functional)
    return getattr(module, name)


def test_every_public_operator_has_its_wrapper_checked():
    assert set(functional.__all__) <= set(WRAPPERS)


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_wrapper_defaults_are_the_declarations(name):
    op, params = WRAPPERS[name], inspect.signature(_wrapper(name)).parameters
    for attr in op.attrs:
        if (name, attr.name) in DERIVED:
            assert attr.name not in params
            continue
        assert attr.name in params, f"{name} does not take attribute '{attr.name}'"
        default = params[attr.name].default
        if default is inspect.Parameter.empty:  # required (e.g. num_experts, k)
            continue
        want = _NONE_MEANS.get(attr.default, attr.default) if isinstance(attr.default, str) \
            else attr.default
        assert default == want and type(default) is type(want), \
            f"{name}({attr.name}={default!r}) but {op.name} declares {attr.default!r}"
    inputs = [p for p in params if p not in {a.name for a in op.attrs}]
    assert inputs == list(op.inputs[:len(inputs)]) or set(inputs) == set(op.inputs), \
        f"{name}'s tensor parameters {inputs} are not {op.name}'s inputs {op.inputs}"
