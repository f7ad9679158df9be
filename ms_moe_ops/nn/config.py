"""The options of the Cells, one object each: RouterConfig (GatingTopK), ExpertsConfig (MoeFFN),
CapacityConfig (ExpertCapacity), SharedExpertsConfig (SharedExperts) and MoEConfig (MoELayer),
which holds every option of the router, the routed experts and their capacity plus the shared
experts' three and hands each part its own config.

An option is declared once, in the config of the Cell it belongs to: MoEConfig takes its fields
from RouterConfig, ExpertsConfig and CapacityConfig, so a new router or experts option reaches MoEConfig,
MoELayer and `moe_config_from_transformers` overrides without being written again. The Cells
check the values (errors name the Cell); the configs only hold them.
"""
import dataclasses
from dataclasses import dataclass
from typing import Optional

__all__ = ["MoEConfig", "RouterConfig", "ExpertsConfig", "CapacityConfig", "SharedExpertsConfig"]


class _Config:
    def replace(self, **changes):
        """A copy with some options changed."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class RouterConfig(_Config):
    """The options of a router (GatingTopK; their meaning: see GatingTopK)."""
    hidden_size: int
    num_experts: int
    top_k: int
    # group-limited choice: the topk_group best of n_group groups (mode 1: by the sum of each
    # group's two best scores, 0: by its best)
    n_group: int = 1
    topk_group: int = 1
    group_select_mode: int = 1
    # the routing weights: scores, renormalisation, scale
    score_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # load balance: the auxiliary-loss-free bias step, and the training losses (0: off)
    bias_update_rate: float = 1e-3
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0


@dataclass(frozen=True)
class ExpertsConfig(_Config):
    """The options of the routed experts (MoeFFN; their meaning: see MoeFFN)."""
    num_experts: int
    hidden_size: int
    ffn_hidden_size: int
    activation: str = "fastgelu"
    has_bias: bool = False
    clamp_limit: float = 0.0
    padded: bool = False


@dataclass(frozen=True)
class CapacityConfig(_Config):
    """The expert capacity (ExpertCapacity, Megatron-Core's token dropping): capacity_factor None
    is dropless; a number c caps every expert at ceil(T * K / E * c) of the (token, slot) pairs
    of a call, dropping the rest by drop_policy ("probs": the lowest routing weights; "position":
    the latest tokens); pad_to_capacity gives every expert exactly that many rows (static
    shapes)."""
    num_experts: int
    top_k: int
    capacity_factor: Optional[float] = None
    drop_policy: str = "probs"
    pad_to_capacity: bool = False


@dataclass(frozen=True)
class SharedExpertsConfig(_Config):
    """The options of the shared experts (SharedExperts: one SwiGLU MLP, optionally gated)."""
    hidden_size: int
    ffn_hidden_size: int
    gate: bool = False


# What MoELayer decides itself rather than takes as an option: the experts' padding follows the
# token dispatcher (the expert-parallel exchange pads), the sizes come first and in this order.
_SIZES = (("hidden_size", int), ("ffn_hidden_size", int), ("num_experts", int), ("top_k", int))
_NOT_OPTIONS = {"padded"}
# The layer's own defaults where they differ from a part's: SwiGLU experts (a bare MoeFFN
# defaults to the fused operator's fastgelu).
_LAYER_DEFAULTS = {"activation": "swiglu"}
# The layer's own options: the shared experts (their width is ffn_hidden_size unless given,
# times n_shared_experts; the gate is Qwen2-MoE's).
_LAYER_OPTIONS = (("n_shared_experts", int, 0), ("shared_ffn_hidden_size", Optional[int], None),
                  ("shared_expert_gate", bool, False))


def _layer_fields():
    out, seen = list(_SIZES), {name for name, _ in _SIZES}
    for part in (RouterConfig, ExpertsConfig, CapacityConfig):
        for f in dataclasses.fields(part):
            if f.name in seen or f.name in _NOT_OPTIONS:
                continue
            seen.add(f.name)
            out.append((f.name, f.type, dataclasses.field(
                default=_LAYER_DEFAULTS.get(f.name, f.default))))
    out.extend((name, kind, dataclasses.field(default=default))
               for name, kind, default in _LAYER_OPTIONS)
    return out


def _part(cls, config, **given):
    """cls (a part's config) from the MoEConfig fields of the same names, and `given`."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{n: getattr(config, n) for n in names if n not in given}, **given)


def _router(self):
    """The router's RouterConfig."""
    return _part(RouterConfig, self)


def _experts(self, num_experts=None, padded=False):
    """The routed experts' ExpertsConfig (num_experts: the experts held here, all by default)."""
    return _part(ExpertsConfig, self, num_experts=num_experts or self.num_experts,
                 padded=padded)


def _capacity(self):
    """The routed experts' CapacityConfig, None when dropless (capacity_factor None)."""
    return None if self.capacity_factor is None else _part(CapacityConfig, self)


def _shared_experts(self):
    """The shared experts' SharedExpertsConfig, None without shared experts. Their width is
    (shared_ffn_hidden_size or ffn_hidden_size) * n_shared_experts (the experts side by side)."""
    if not self.n_shared_experts:
        return None
    width = (self.shared_ffn_hidden_size or self.ffn_hidden_size) * self.n_shared_experts
    return SharedExpertsConfig(self.hidden_size, width, gate=self.shared_expert_gate)


MoEConfig = dataclasses.make_dataclass(
    "MoEConfig", _layer_fields(), bases=(_Config,), frozen=True,
    namespace={"__module__": __name__, "__qualname__": "MoEConfig", "router": _router,
               "experts": _experts, "capacity": _capacity,
               "shared_experts": _shared_experts, "__doc__": """\
The options of a MoELayer: `MoELayer(config)` builds a layer, `layer.config` gives it back,
`config.replace(top_k=4)` makes a variant and `moe_config_from_transformers` reads one from a
transformers model configuration.

Fields: hidden_size, ffn_hidden_size, num_experts, top_k (in this order), then every option
of RouterConfig, ExpertsConfig (but padded) and CapacityConfig with their defaults, but
activation="swiglu", then n_shared_experts=0, shared_ffn_hidden_size=None and
shared_expert_gate=False. `config.router()`, `config.experts()`, `config.capacity()` and
`config.shared_experts()` give each part its own.

The defaults are DeepSeek-V3's routing (sigmoid scores, renormalised top-k) with SwiGLU experts
and no training loss."""})
