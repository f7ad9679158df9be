"""Tiny transformers MoE language models with random weights, and their checkpoints in both
layouts (nothing is downloaded). Used by test_convert.py and test_models.py."""
import json
import os

import numpy as np

FAMILIES = ("deepseek_v3", "deepseek_v2", "qwen3_moe", "qwen2_moe", "mixtral")


def hf_config(family, layers=3, **overrides):
    """A tiny configuration: hidden 32, 8 routed experts (top-2), 3 layers, the first dense
    where the family has dense layers."""
    import transformers

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    deepseek = dict(moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                    n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=16,
                    kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                    num_key_value_heads=4)
    qwen = dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, head_dim=8,
                mlp_only_layers=[0])
    if family == "deepseek_v3":
        options = {**common, **deepseek, "n_shared_experts": 1, "routed_scaling_factor": 2.5}
        cls = transformers.DeepseekV3Config
    elif family == "deepseek_v2":
        options = {**common, **deepseek, "n_shared_experts": 2, "routed_scaling_factor": 1.5,
                   "topk_method": "group_limited_greedy"}
        cls = transformers.DeepseekV2Config
    elif family == "qwen3_moe":
        options = {**common, **qwen, "norm_topk_prob": True}
        cls = transformers.Qwen3MoeConfig
    elif family == "qwen2_moe":
        options = {**common, **qwen, "shared_expert_intermediate_size": 24}
        cls = transformers.Qwen2MoeConfig
    else:
        options = {**common, "num_local_experts": 8, "num_experts_per_tok": 2}
        cls = transformers.MixtralConfig
    return cls(**{**options, **overrides})


def hf_model(family, rng, layers=3, **overrides):
    """A float32 transformers causal LM of the family with random weights of unit-scale
    activations: projections N(0, 1/fan_in), norms 1 + N(0, 0.1^2), routers N(0, 0.5^2) (no
    routing choice is a near tie), DeepSeek-V3's selection bias N(0, 0.05^2)."""
    import torch
    import transformers

    config = hf_config(family, layers, **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, value in model.state_dict().items():
            shape = tuple(value.shape)
            if "norm" in name:
                new = 1 + 0.1 * rng.standard_normal(shape)
            elif name.endswith("gate.weight"):
                new = 0.5 * rng.standard_normal(shape)
            elif "bias" in name:
                new = 0.05 * rng.standard_normal(shape)
            else:
                new = rng.standard_normal(shape) / np.sqrt(shape[-1])
            value.copy_(torch.from_numpy(new.astype(np.float32)))
    return model


def save(model, path, layout="per-expert", shards=1, dtype="float32"):
    """model's checkpoint at path: "per-expert" as save_pretrained writes it (the Hub's layout;
    shards: about that many files), "fused" as transformers 5 holds it (its state dict, cut
    into `shards` files with an index). dtype: float32, bfloat16 or float16."""
    import torch
    from safetensors.torch import save_file

    model = model.to(getattr(torch, dtype))
    for module in model.modules():  # kept in float32, as transformers keeps it
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    if layout == "per-expert":
        size = sum(v.numel() * v.element_size() for v in model.state_dict().values())
        model.save_pretrained(path, max_shard_size=max(size // shards + 1, 1024))
    else:
        os.makedirs(path, exist_ok=True)
        model.config.save_pretrained(path)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        names = sorted(state)
        parts = np.array_split(np.array(names), shards)
        files = ([f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
                 if shards > 1 else ["model.safetensors"])
        for file, part in zip(files, parts):
            save_file({n: state[n] for n in part}, os.path.join(path, file), {"format": "pt"})
        if shards > 1:
            index = {"metadata": {}, "weight_map": {n: f for f, p in zip(files, parts) for n in p}}
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f)
    model.float()
    return path
