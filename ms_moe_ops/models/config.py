"""CausalLMConfig: everything a whole MoE language model needs, read from a transformers
`config.json` (DeepSeek-V3, DeepSeek-V2, Qwen3-MoE, Qwen2-MoE, Mixtral); its MoE blocks are one
MoEConfig."""
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional, Tuple, Union

import numpy as np

from ..nn.config import MoEConfig
from ..nn.families import moe_config_from_transformers

__all__ = ["CausalLMConfig", "GQAConfig", "MLAConfig", "RopeConfig", "read_transformers_config"]


@dataclass(frozen=True)
class GQAConfig:
    """Grouped-query attention (Qwen3-MoE, Qwen2-MoE, Mixtral): q/k/v/o projections, each group
    of num_heads / num_kv_heads query heads sharing one key/value head."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool = False            # Qwen3-MoE: RMSNorm over each head of q and k
    qkv_bias: bool = False           # biases on q, k and v (Qwen2-MoE; Qwen3-MoE's attention_bias)
    o_bias: bool = False             # a bias on o (Qwen3-MoE's attention_bias)
    sliding_window: Optional[int] = None  # keys at most this many positions back (None: all)
    norm_eps: float = 1e-6

    @property
    def scaling(self):
        return self.head_dim ** -0.5


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: queries through a LoRA bottleneck (q_a_proj ->
    RMSNorm -> q_b_proj; one q_proj without q_lora_rank), keys and values from a shared latent of
    kv_lora_rank (kv_a_proj_with_mqa -> RMSNorm -> kv_b_proj), each query/key head made of
    qk_nope_head_dim position-free dims and qk_rope_head_dim rotary dims, the rotary key shared
    by all heads."""
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int] = None
    bias: bool = False               # attention_bias: q_a_proj, kv_a_proj_with_mqa, o_proj
    interleave: bool = True          # rotary dims paired as (0, 1), (2, 3), ... (else halves)
    scaling: float = 0.0             # softmax scale (qk_head_dim^-0.5, times YaRN's mscale^2)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding of `dim` dims: the default (theta^(-2i/dim)) or YaRN."""
    dim: int
    theta: float = 10000.0
    kind: str = "default"            # "default" or "yarn"
    factor: Optional[float] = None
    original_max_position_embeddings: Optional[int] = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True
    max_position_embeddings: int = 4096

    def inv_freq(self):
        """float32 [dim / 2], computed as transformers computes it (float32 throughout)."""
        exponents = np.arange(0, self.dim, 2, dtype=np.float32) / np.float32(self.dim)
        pos_freqs = np.float32(self.theta) ** exponents
        if self.kind == "default":
            return (np.float32(1.0) / pos_freqs).astype(np.float32)
        # YaRN: interpolated frequencies below the correction range, extrapolated above
        factor = self.scale_factor()
        low, high = (self._correction_dim(self.beta_fast), self._correction_dim(self.beta_slow))
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(self.dim // 2, dtype=np.float32) - np.float32(low))
                       / np.float32(high - low), 0, 1).astype(np.float32)
        extrapolation = np.float32(1) - ramp
        inv_extra = np.float32(1.0) / pos_freqs
        inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
        return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)

    def attention_scaling(self):
        """The factor on cos and sin (1 for the default rotary embedding)."""
        if self.kind == "default":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        factor = self.scale_factor()
        if self.mscale and self.mscale_all_dim:
            return float(_yarn_mscale(factor, self.mscale)
                         / _yarn_mscale(factor, self.mscale_all_dim))
        return _yarn_mscale(factor)

    def scale_factor(self):
        """YaRN's factor: given, or max_position_embeddings / original_max_position_embeddings."""
        if self.factor is not None:
            return self.factor
        return self.max_position_embeddings / self.original_max_position_embeddings

    def _correction_dim(self, rotations):
        return (self.dim * math.log(self.original_max_position_embeddings
                                    / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))


def _yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class CausalLMConfig:
    """One decoder-only MoE language model: embedding, `num_layers` pre-norm blocks (attention,
    then a feed-forward block: a MoELayer of `moe` in the layers listed in `moe_layers`, a dense
    SwiGLU MLP of `intermediate_size` in the others), final RMSNorm and the output projection
    (the embedding itself when tie_word_embeddings).

    `CausalLMConfig.from_transformers(c)` reads it from a transformers configuration (a
    `config.json` path or directory, its dict, or a transformers config object)."""
    family: str                      # transformers' model_type
    vocab_size: int
    hidden_size: int
    num_layers: int
    attention: Union[GQAConfig, MLAConfig]
    rope: RopeConfig
    moe: MoEConfig
    moe_layers: Tuple[int, ...]
    intermediate_size: int = 0       # the dense MLP of the other layers
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False

    def replace(self, **changes):
        """A copy with some fields changed (`moe=config.moe.replace(bias_update_rate=1e-3)`)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_transformers(cls, config, **moe_overrides):
        """The configuration of a transformers model: a path to `config.json` or its directory,
        the dict it holds, or a transformers config object; moe_overrides set MoEConfig options
        (training losses, bias_update_rate)."""
        c = read_transformers_config(config)
        family = c.model_type
        heads = c.num_attention_heads
        layers = range(c.num_hidden_layers)
        if family in ("deepseek_v3", "deepseek_v2"):
            rope = _rope(c, c.qk_rope_head_dim)
            qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
            scaling = qk_head_dim ** -0.5
            if rope.kind != "default" and rope.mscale_all_dim:  # YaRN's softmax scale
                scaling *= _yarn_mscale(rope.scale_factor(), rope.mscale_all_dim) ** 2
            attention = MLAConfig(
                heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                q_lora_rank=c.q_lora_rank, bias=bool(c.attention_bias),
                # DeepSeek-V2 always pairs neighbouring dims (a complex product)
                interleave=bool(getattr(c, "rope_interleave", True)), scaling=scaling)
            moe_layers = tuple(i for i in layers if i >= c.first_k_dense_replace)
        else:
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
            window = None
            if family == "mixtral":
                window = c.sliding_window
            elif getattr(c, "use_sliding_window", False):
                raise ValueError(f"CausalLMConfig: {family} with use_sliding_window=True (sliding "
                                 f"window on some layers only) is not supported")
            bias = {"qwen2_moe": (bool(getattr(c, "qkv_bias", True)), False),
                    "qwen3_moe": (bool(c.attention_bias),) * 2}.get(family, (False, False))
            attention = GQAConfig(heads, c.num_key_value_heads or heads, head_dim,
                                  qk_norm=family == "qwen3_moe", qkv_bias=bias[0], o_bias=bias[1],
                                  sliding_window=window, norm_eps=c.rms_norm_eps)
            rope = _rope(c, head_dim)
            if family == "mixtral":
                moe_layers = tuple(layers)
            else:
                skip = set(getattr(c, "mlp_only_layers", None) or ())
                step = getattr(c, "decoder_sparse_step", 1) or 1
                moe_layers = tuple(i for i in layers
                                   if i not in skip and c.num_experts > 0 and (i + 1) % step == 0)
        return cls(family=family, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                   num_layers=c.num_hidden_layers, attention=attention, rope=rope,
                   moe=moe_config_from_transformers(c, **moe_overrides), moe_layers=moe_layers,
                   intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
                   tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)))

    def parameter_shapes(self):
        """{parameter name: shape} of the model's checkpoint: every trainable parameter and the
        routers' expert_bias (not the routing statistics). Non-MoE names and shapes are those of
        transformers' model; a MoE block at `model.layers.{i}.mlp.` holds MoELayer's parameters.
        tests/test_models.py checks it against the Cells."""
        h, v = self.hidden_size, self.vocab_size
        shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (v, h)
        for i in range(self.num_layers):
            prefix = f"model.layers.{i}."
            shapes[prefix + "input_layernorm.weight"] = (h,)
            shapes[prefix + "post_attention_layernorm.weight"] = (h,)
            for name, shape in _attention_shapes(self.attention, h).items():
                shapes[prefix + "self_attn." + name] = shape
            mlp = prefix + "mlp."
            if i in self.moe_layers:
                shapes.update({mlp + k: s for k, s in moe_parameter_shapes(self.moe).items()})
            else:
                f = self.intermediate_size
                shapes.update({mlp + "gate_proj.weight": (f, h), mlp + "up_proj.weight": (f, h),
                               mlp + "down_proj.weight": (h, f)})
        return shapes


def moe_parameter_shapes(moe):
    """{name: shape} of a MoELayer's checkpoint parameters (SwiGLU experts)."""
    h, f, e = moe.hidden_size, moe.ffn_hidden_size, moe.num_experts
    shapes = {"router.weight": (e, h), "router.expert_bias": (e,),
              "experts.weight1": (e, h, 2 * f), "experts.weight2": (e, f, h)}
    if moe.n_shared_experts:
        fs = (moe.shared_ffn_hidden_size or f) * moe.n_shared_experts
        shapes.update({"shared_experts.weight1": (h, 2 * fs), "shared_experts.weight2": (fs, h)})
        if moe.shared_expert_gate:
            shapes["shared_experts.gate"] = (h,)
    return shapes


def _attention_shapes(a, h):
    if isinstance(a, GQAConfig):
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        shapes = {"q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
                  "o_proj.weight": (h, q)}
        if a.qkv_bias:
            shapes.update({"q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
        if a.o_bias:
            shapes["o_proj.bias"] = (h,)
        if a.qk_norm:
            shapes.update({"q_norm.weight": (a.head_dim,), "k_norm.weight": (a.head_dim,)})
        return shapes
    qk = a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
    shapes = {"kv_a_proj_with_mqa.weight": (a.kv_lora_rank + a.qk_rope_head_dim, h),
              "kv_a_layernorm.weight": (a.kv_lora_rank,),
              "kv_b_proj.weight": (a.num_heads * (a.qk_nope_head_dim + a.v_head_dim),
                                   a.kv_lora_rank),
              "o_proj.weight": (h, a.num_heads * a.v_head_dim)}
    if a.q_lora_rank is None:
        shapes["q_proj.weight"] = (qk, h)
    else:
        shapes.update({"q_a_proj.weight": (a.q_lora_rank, h),
                       "q_a_layernorm.weight": (a.q_lora_rank,),
                       "q_b_proj.weight": (qk, a.q_lora_rank)})
    if a.bias:
        shapes["kv_a_proj_with_mqa.bias"] = (a.kv_lora_rank + a.qk_rope_head_dim,)
        shapes["o_proj.bias"] = (h,)
        if a.q_lora_rank is not None:
            shapes["q_a_proj.bias"] = (a.q_lora_rank,)
    return shapes


def _rope(c, dim):
    """RopeConfig from transformers 5's rope_parameters or the older rope_theta/rope_scaling."""
    params = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(c, "rope_theta", None) or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ValueError(f"CausalLMConfig: rotary embedding {kind!r} is not supported (default "
                         f"and yarn are)")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("CausalLMConfig: partial_rotary_factor is not supported")
    max_pos = getattr(c, "max_position_embeddings", 4096)
    if kind == "default":
        return RopeConfig(dim, float(theta), max_position_embeddings=max_pos)
    return RopeConfig(
        dim, float(theta), "yarn", factor=params.get("factor"),
        original_max_position_embeddings=params.get("original_max_position_embeddings", max_pos),
        beta_fast=params.get("beta_fast") or 32.0, beta_slow=params.get("beta_slow") or 1.0,
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=params.get("truncate", True),
        max_position_embeddings=max_pos)


# The options config.json may leave out, with transformers' defaults (5.18).
_DEFAULTS = {
    "common": dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
                   attention_bias=False, max_position_embeddings=4096, num_key_value_heads=None,
                   head_dim=None),
    "deepseek_v3": dict(first_k_dense_replace=3, q_lora_rank=1536, n_group=8, topk_group=4,
                        routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1,
                        rope_interleave=True),
    "deepseek_v2": dict(first_k_dense_replace=0, q_lora_rank=1536, n_group=None, topk_group=None,
                        topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False,
                        n_shared_experts=2),
    "qwen3_moe": dict(norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                      use_sliding_window=False),
    "qwen2_moe": dict(norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                      use_sliding_window=False, qkv_bias=True),
    "mixtral": dict(rms_norm_eps=1e-5, sliding_window=None, intermediate_size=14336),
}


# Other names of the same options (transformers' attribute_map), -> the name read here.
_ALIASES = {"deepseek_v3": {"num_local_experts": "n_routed_experts"},
            "deepseek_v2": {"num_experts": "n_routed_experts"},
            "qwen3_moe": {"num_local_experts": "num_experts"},
            "qwen2_moe": {"num_local_experts": "num_experts"},
            "mixtral": {"num_experts": "num_local_experts"}}


def read_transformers_config(config):
    """A transformers model configuration as an object with its attributes: from a path to
    config.json (or its directory), a dict, or a transformers config object. Options
    config.json may leave out get transformers' defaults; a family this package does not know
    is a ValueError."""
    source = "config"
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        source = path
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such file (a transformers checkpoint directory "
                                    f"holds config.json)") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
    elif not isinstance(config, dict):
        if not hasattr(config, "to_dict"):
            raise TypeError(f"a transformers configuration must be a path, a dict or a config "
                            f"object, got {type(config).__name__}")
        config = config.to_dict()
    family = config.get("model_type")
    if family not in _DEFAULTS or family == "common":
        known = sorted(k for k in _DEFAULTS if k != "common")
        raise ValueError(f"{source}: model_type must be one of {known}, got {family!r}")
    config = dict(config)
    for alias, name in _ALIASES[family].items():
        if config.get(name) is None and config.get(alias) is not None:
            config[name] = config[alias]
    values = {**_DEFAULTS["common"], **_DEFAULTS[family], **config}
    required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_experts_per_tok"]
    required += {"mixtral": ["num_local_experts"], "qwen3_moe": ["num_experts",
                 "moe_intermediate_size", "intermediate_size"],
                 "qwen2_moe": ["num_experts", "moe_intermediate_size", "intermediate_size",
                               "shared_expert_intermediate_size"]}.get(
        family, ["n_routed_experts", "moe_intermediate_size", "intermediate_size",
                 "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"])
    missing = [k for k in required if values.get(k) is None]
    if missing:
        raise ValueError(f"{source}: {family} configuration without {missing}")
    if values.get("quantization_config"):
        method = values["quantization_config"].get("quant_method", "?")
        raise ValueError(f"{source}: a quantized checkpoint ({method}); convert a float one "
                         f"(bfloat16, float16 or float32)")
    return SimpleNamespace(**values)
