"""Where the tensors of a MoE block live in a transformers checkpoint, and the way back.

A MoE block of layer i is `model.layers.{i}.mlp.` in the models of `ms_moe_ops.models` (a
MoELayer). In a transformers checkpoint it is, relative to `model.layers.{i}.mlp.` (Mixtral on
the Hub: `model.layers.{i}.block_sparse_moe.`), in one of two layouts:
- "per-expert" (the Hub's, and what transformers' save_pretrained writes):
  `experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I] (Mixtral: w1, w3, w2);
- "fused" (transformers 5's own parameters): `experts.gate_up_proj` [E, 2I, H] (gate rows first),
  `experts.down_proj` [E, H, I];
next to the router `gate.weight` [E, H] (DeepSeek-V3: and `gate.e_score_correction_bias` [E])
and the shared experts (DeepSeek: `shared_experts.{gate,up,down}_proj.weight`; Qwen2-MoE:
`shared_expert.*` and `shared_expert_gate.weight` [1, H]).

The names come from `ms_moe_ops.nn.families.FAMILIES`; the forward conversion is
`convert_moe_checkpoint`, the way back `export_block` below.
"""
import numpy as np

from ..nn.families import FAMILIES

__all__ = ["LAYOUTS", "block_prefixes", "export_prefix", "block_tensors", "export_block"]

LAYOUTS = ("per-expert", "fused")


def block_prefixes(family, layer):
    """The prefixes a checkpoint may hold layer `layer`'s MoE block under, the Hub's first."""
    mlp = f"model.layers.{layer}.mlp."
    return (f"model.layers.{layer}.block_sparse_moe.", mlp) if family == "mixtral" else (mlp,)


def export_prefix(family, layer, layout):
    """The prefix export writes a block under: Mixtral's Hub name for the per-expert layout."""
    return block_prefixes(family, layer)[0 if layout == "per-expert" else -1]


def block_tensors(moe, family, layout):
    """[(MoELayer parameter, [(transformers name relative to the block, shape), ...])]: which
    checkpoint tensors make each parameter, in the given layout ("per-expert" or "fused")."""
    names = FAMILIES[family]
    e, h, i = moe.num_experts, moe.hidden_size, moe.ffn_hidden_size
    gate, up, down = names.experts
    out = [("router.weight", [("gate.weight", (e, h))]),
           ("router.expert_bias", [(names.bias, (e,))] if names.bias else [])]
    if layout == "fused":
        out += [("experts.weight1", [("experts.gate_up_proj", (e, 2 * i, h))]),
                ("experts.weight2", [("experts.down_proj", (e, h, i))])]
    else:
        out += [("experts.weight1", [(f"experts.{x}.{n}.weight", (i, h))
                                     for x in range(e) for n in (gate, up)]),
                ("experts.weight2", [(f"experts.{x}.{down}.weight", (h, i)) for x in range(e)])]
    if moe.n_shared_experts:
        fs = (moe.shared_ffn_hidden_size or i) * moe.n_shared_experts
        stem = names.shared
        out += [("shared_experts.weight1", [(f"{stem}gate_proj.weight", (fs, h)),
                                            (f"{stem}up_proj.weight", (fs, h))]),
                ("shared_experts.weight2", [(f"{stem}down_proj.weight", (h, fs))])]
        if moe.shared_expert_gate:
            out.append(("shared_experts.gate", [(names.shared_gate, (1, h))]))
    return out


def export_block(params, family, layout, where=""):
    """MoELayer parameters {name relative to the block: numpy} -> {transformers name relative to
    the block: numpy} in the given layout: the inverse of convert_moe_checkpoint (bit for bit).
    A non-zero router.expert_bias in a family without a selection bias is a ValueError (the
    transformers model could not reproduce the routing)."""
    names = FAMILIES[family]
    gate, up, down = names.experts
    w1, w2 = params["experts.weight1"], params["experts.weight2"]  # [E, H, 2I], [E, I, H]
    i = w2.shape[1]
    out = {"gate.weight": params["router.weight"]}
    bias = params["router.expert_bias"]
    if names.bias:
        out[names.bias] = bias
    elif np.any(bias != 0):
        raise ValueError(f"export: {where}router.expert_bias is not zero, but {family} "
                         f"checkpoints have no selection bias (train with bias_update_rate=0 "
                         f"for this family, or export to deepseek_v3)")
    if layout == "fused":
        out["experts.gate_up_proj"] = w1.transpose(0, 2, 1)
        out["experts.down_proj"] = w2.transpose(0, 2, 1)
    else:
        for x in range(w1.shape[0]):
            out[f"experts.{x}.{gate}.weight"] = w1[x, :, :i].T
            out[f"experts.{x}.{up}.weight"] = w1[x, :, i:].T
            out[f"experts.{x}.{down}.weight"] = w2[x].T
    if "shared_experts.weight1" in params:
        s1, s2 = params["shared_experts.weight1"], params["shared_experts.weight2"]
        fs = s2.shape[0]
        out[f"{names.shared}gate_proj.weight"] = s1[:, :fs].T
        out[f"{names.shared}up_proj.weight"] = s1[:, fs:].T
        out[f"{names.shared}down_proj.weight"] = s2.T
        if "shared_experts.gate" in params:
            out[names.shared_gate] = params["shared_experts.gate"].reshape(1, -1)
    return out
