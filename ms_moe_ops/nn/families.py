"""The MoE blocks of transformers' model families as MoELayers: options from a model
configuration, and checkpoint converters.

Checkpoints come in two layouts, and every converter reads both:
- per expert, as on the Hugging Face Hub: `experts.{e}.gate_proj.weight` [I, H],
  `experts.{e}.up_proj.weight` [I, H], `experts.{e}.down_proj.weight` [H, I] (Mixtral:
  `experts.{e}.w1`, `w3`, `w2`);
- fused, as transformers 5 holds them: `experts.gate_up_proj` [E, 2I, H] (gate rows first) and
  `experts.down_proj` [E, H, I].
"""
from collections import namedtuple

import numpy as np

from .config import MoEConfig

__all__ = ["moe_config_from_transformers", "convert_moe_checkpoint", "convert_deepseek_v3_moe",
           "convert_deepseek_v2_moe", "convert_qwen3_moe", "convert_qwen2_moe",
           "convert_mixtral_moe", "FAMILIES", "Family", "Attr"]


class Attr(namedtuple("Attr", "name")):
    """An option read from the transformers configuration's attribute `name`."""

    def read(self, config):
        return getattr(config, self.name)


def _grouped(value):
    """DeepSeek-V2's group options: read only with topk_method="group_limited_greedy" (1
    otherwise: no groups)."""
    def read(config):
        return getattr(config, value) if config.topk_method == "group_limited_greedy" else 1
    return read


# A family's MoE block, as data.
#   experts: per-expert checkpoint names of the (gate, up, down) projections
#   shared: stem of the shared experts' MLP (None: the family has none)
#   shared_gate: Qwen2-MoE's shared-expert gate [1, H]
#   bias: DeepSeek-V3's selection bias
#   options: MoEConfig option -> its value: an Attr of the transformers configuration, a
#       function of that configuration, or a constant (every family also reads _OPTIONS)
#   defaults: the routing attributes of the family's transformers configuration class at their
#       defaults there (what MoEConfig.for_family reads; tests/test_families.py compares them with
#       transformers' own), sizes excluded
Family = namedtuple("Family", "experts shared shared_gate bias options defaults", defaults=({}, {}))
_SWIGLU = ("gate_proj", "up_proj", "down_proj")
_OPTIONS = dict(hidden_size=Attr("hidden_size"), top_k=Attr("num_experts_per_tok"))
_QWEN = dict(ffn_hidden_size=Attr("moe_intermediate_size"), num_experts=Attr("num_experts"),
             score_func="softmax", norm_topk_prob=Attr("norm_topk_prob"))
FAMILIES = {
    "deepseek_v3": Family(_SWIGLU, "shared_experts.", None, "gate.e_score_correction_bias", dict(
        ffn_hidden_size=Attr("moe_intermediate_size"), num_experts=Attr("n_routed_experts"),
        n_group=Attr("n_group"), topk_group=Attr("topk_group"), group_select_mode=1,
        routed_scaling_factor=Attr("routed_scaling_factor"),
        norm_topk_prob=Attr("norm_topk_prob"), n_shared_experts=Attr("n_shared_experts")),
        dict(n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
             n_shared_experts=1)),
    # transformers' DeepseekV2 router never renormalises (norm_topk_prob is unused there)
    "deepseek_v2": Family(_SWIGLU, "shared_experts.", None, None, dict(
        ffn_hidden_size=Attr("moe_intermediate_size"), num_experts=Attr("n_routed_experts"),
        score_func="softmax", n_group=_grouped("n_group"), topk_group=_grouped("topk_group"),
        group_select_mode=0, routed_scaling_factor=Attr("routed_scaling_factor"),
        norm_topk_prob=False, n_shared_experts=Attr("n_shared_experts")),
        dict(topk_method="greedy", n_group=None, topk_group=None, routed_scaling_factor=1.0,
             n_shared_experts=2)),
    "qwen3_moe": Family(_SWIGLU, None, None, None, _QWEN, dict(norm_topk_prob=False)),
    "qwen2_moe": Family(_SWIGLU, "shared_expert.", "shared_expert_gate.weight", None, dict(
        _QWEN, n_shared_experts=1, shared_ffn_hidden_size=Attr("shared_expert_intermediate_size"),
        shared_expert_gate=True), dict(norm_topk_prob=False)),
    "mixtral": Family(("w1", "w3", "w2"), None, None, None, dict(
        ffn_hidden_size=Attr("intermediate_size"), num_experts=Attr("num_local_experts"),
        score_func="softmax")),
}


# -- options ------------------------------------------------------------------------------------

def _value(option, config):
    if isinstance(option, Attr):
        return option.read(config)
    return option(config) if callable(option) else option


def moe_config_from_transformers(config, **overrides):
    """The MoEConfig of the MoE blocks of a transformers model configuration
    (`DeepseekV3Config`, `DeepseekV2Config`, `Qwen3MoeConfig`, `Qwen2MoeConfig`,
    `MixtralConfig`, or any object with their attributes and `model_type`); overrides set other
    options, e.g. the training losses (`aux_loss_coeff=config.router_aux_loss_coef`). What each
    family reads: `FAMILIES[model_type].options`.

    Not reproduced: Mixtral's training-time router jitter noise (off by default)."""
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        raise ValueError(f"moe_config_from_transformers: model_type must be one of "
                         f"{sorted(FAMILIES)}, got {kind!r}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"moe_config_from_transformers: the experts must be SwiGLU "
                         f"(hidden_act='silu'), got hidden_act={config.hidden_act!r}")
    options = {**_OPTIONS, **FAMILIES[kind].options}
    return MoEConfig(**{**{name: _value(option, config) for name, option in options.items()},
                        **overrides})


def _for_family(cls, family, **options):
    """The MoEConfig of a family's MoE block without a transformers configuration: the family's
    routing as its transformers configuration class has it by default (`FAMILIES[family]`:
    DeepSeek-V3's sigmoid scores in 8 groups, top 4 groups, scaled by 2.5; DeepSeek-V2's greedy
    softmax; ...) with your sizes and options, which win over the family's:
    `MoEConfig.for_family("deepseek_v3", hidden_size=1024, ffn_hidden_size=512, num_experts=64,
    top_k=8)`. hidden_size, ffn_hidden_size, num_experts and top_k are yours to give; so is
    shared_ffn_hidden_size (Qwen2-MoE's shared expert width; default ffn_hidden_size). A checkpoint's
    own config.json may differ from these defaults (Qwen3-30B-A3B sets norm_topk_prob=True):
    read it with moe_config_from_transformers."""
    if family not in FAMILIES:
        raise ValueError(f"MoEConfig.for_family: family must be one of {sorted(FAMILIES)}, got "
                         f"{family!r}")
    defaults = FAMILIES[family].defaults
    config = _Defaults(**defaults)
    known = {name: option for name, option in {**_OPTIONS, **FAMILIES[family].options}.items()
             if not isinstance(option, Attr) or option.name in defaults}
    try:
        return cls(**{**{name: _value(option, config) for name, option in known.items()},
                      **options})
    except TypeError as error:  # sizes missing, an unknown option
        raise TypeError(f"MoEConfig.for_family({family!r}): "
                        f"{str(error).replace('MoEConfig.__init__() ', '')}") from None


class _Defaults:
    """A transformers configuration holding only a family's defaults (see _for_family)."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


# (a classmethod of MoEConfig defined beside the families' data: config.py, which this module
# imports, cannot import it)
MoEConfig.for_family = classmethod(_for_family)


# -- checkpoints ----------------------------------------------------------------------------------

def convert_moe_checkpoint(state_dict, src_prefix, dst_prefix, family, num_experts=None):
    """One MoE block of a transformers/Hub state dict -> {MoELayer parameter name: numpy
    float32}, for a MoELayer at dst_prefix.

    Args:
        state_dict: name -> numpy array (torch layout [out, in]); per-expert or fused experts.
        src_prefix: the block's prefix with its dot, e.g. "model.layers.3.mlp." (Mixtral on the
            Hub: "model.layers.3.block_sparse_moe."). Every name under it must be understood.
        dst_prefix: the MoELayer's prefix, e.g. "layers.3.moe." ("" for a bare MoELayer).
        family: a key of FAMILIES ("deepseek_v3", "deepseek_v2", "qwen3_moe", "qwen2_moe",
            "mixtral").
        num_experts: checked against the router's rows when given.

    Returns:
        router.weight, router.expert_bias (zeros when the family has none), experts.weight1
        [E, H, 2I], experts.weight2 [E, I, H] and, with shared experts, shared_experts.weight1
        [H, 2Is], shared_experts.weight2 [Is, H] (and shared_experts.gate [H]): every parameter
        of the layer but its state (router.tokens_per_expert and router.aux_losses, which a
        fresh layer holds at zero, and the training losses' loss scale, 1). Load it with
        `ms.load_param_into_net(layer, {k: Parameter(Tensor(v), name=k) ...},
        strict_load=True)`; to load without MindSpore's warning about the state, add the
        layer's own (`examples/from_hf.py` does).
    """
    if family not in FAMILIES:
        raise ValueError(f"convert_moe_checkpoint: family must be one of {sorted(FAMILIES)}, "
                         f"got {family!r}")
    names = FAMILIES[family]
    used = set()

    def has(name):
        return src_prefix + name in state_dict

    def get(name):
        if not has(name):
            raise KeyError(f"convert_moe_checkpoint ({family}): '{src_prefix + name}' is not in "
                           f"the state dict")
        used.add(src_prefix + name)
        return np.asarray(state_dict[src_prefix + name], np.float32)

    router = get("gate.weight")
    e, h = router.shape
    if num_experts is not None and num_experts != e:
        raise ValueError(f"convert_moe_checkpoint: num_experts={num_experts}, but "
                         f"'{src_prefix}gate.weight' has {e} rows")
    out = {"router.weight": router,
           "router.expert_bias": get(names.bias) if names.bias and has(names.bias) else
           np.zeros(e, np.float32)}
    if has("experts.gate_up_proj"):
        gate_up, down = get("experts.gate_up_proj"), get("experts.down_proj")  # [E, 2I, H], [E, H, I]
        _check_fused(src_prefix, gate_up, down, e, h)
        out["experts.weight1"] = gate_up.transpose(0, 2, 1)
        out["experts.weight2"] = down.transpose(0, 2, 1)
    else:
        pairs = [_swiglu(get, f"experts.{i}.", names.experts) for i in range(e)]
        out["experts.weight1"] = np.stack([w1 for w1, _ in pairs])
        out["experts.weight2"] = np.stack([w2 for _, w2 in pairs])
    if names.shared and has(names.shared + "gate_proj.weight"):
        out["shared_experts.weight1"], out["shared_experts.weight2"] = _swiglu(
            get, names.shared, _SWIGLU)
        if names.shared_gate:
            out["shared_experts.gate"] = get(names.shared_gate).reshape(-1)
    unknown = sorted(k for k in state_dict if k.startswith(src_prefix) and k not in used)
    if unknown:
        raise ValueError(f"convert_moe_checkpoint ({family}): names under '{src_prefix}' this "
                         f"family does not have: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    return {dst_prefix + k: np.ascontiguousarray(v) for k, v in out.items()}


def _swiglu(get, stem, names):
    """(weight1 [H, 2I] = gate | up columns, weight2 [I, H]) of one MLP in torch layout."""
    gate, up, down = (get(f"{stem}{n}.weight") for n in names)
    return np.concatenate([gate.T, up.T], axis=1), down.T


def _check_fused(prefix, gate_up, down, e, h):
    if gate_up.ndim != 3 or gate_up.shape[0] != e or gate_up.shape[2] != h or gate_up.shape[1] % 2:
        raise ValueError(f"convert_moe_checkpoint: '{prefix}experts.gate_up_proj' must be "
                         f"[{e}, 2I, {h}], got {list(gate_up.shape)}")
    if down.shape != (e, h, gate_up.shape[1] // 2):
        raise ValueError(f"convert_moe_checkpoint: '{prefix}experts.down_proj' must be "
                         f"[{e}, {h}, {gate_up.shape[1] // 2}], got {list(down.shape)}")


def convert_deepseek_v3_moe(state_dict, src_prefix, dst_prefix, num_experts=None):
    """One DeepSeek-V3 MoE block (router with `gate.e_score_correction_bias`, shared experts)
    -> MoELayer parameters; see convert_moe_checkpoint."""
    return convert_moe_checkpoint(state_dict, src_prefix, dst_prefix, "deepseek_v3", num_experts)


def convert_deepseek_v2_moe(state_dict, src_prefix, dst_prefix, num_experts=None):
    """One DeepSeek-V2 MoE block (shared experts) -> MoELayer parameters; see
    convert_moe_checkpoint."""
    return convert_moe_checkpoint(state_dict, src_prefix, dst_prefix, "deepseek_v2", num_experts)


def convert_qwen3_moe(state_dict, src_prefix, dst_prefix, num_experts=None):
    """One Qwen3-MoE block -> MoELayer parameters; see convert_moe_checkpoint."""
    return convert_moe_checkpoint(state_dict, src_prefix, dst_prefix, "qwen3_moe", num_experts)


def convert_qwen2_moe(state_dict, src_prefix, dst_prefix, num_experts=None):
    """One Qwen2-MoE block (`shared_expert.*` and `shared_expert_gate.weight` [1, H]) ->
    MoELayer parameters; see convert_moe_checkpoint."""
    return convert_moe_checkpoint(state_dict, src_prefix, dst_prefix, "qwen2_moe", num_experts)


def convert_mixtral_moe(state_dict, src_prefix, dst_prefix, num_experts=None):
    """One Mixtral MoE block (Hub: `block_sparse_moe.experts.{e}.w1/w2/w3.weight`; transformers
    5: `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) -> MoELayer parameters; see
    convert_moe_checkpoint."""
    return convert_moe_checkpoint(state_dict, src_prefix, dst_prefix, "mixtral", num_experts)
