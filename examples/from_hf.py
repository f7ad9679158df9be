"""Load the MoE blocks of transformers models into ms_moe_ops.MoELayer and check that they agree.

For each family (DeepSeek-V3, DeepSeek-V2, Qwen3-MoE, Qwen2-MoE, Mixtral) this builds a tiny
transformers causal language model with random weights (nothing is downloaded), runs it on random
token ids while recording the input and output of every MoE block, and converts each block's
weights from both checkpoint layouts: transformers 5's fused state dict and the per-expert layout
that `save_pretrained` writes (the layout of checkpoints on the Hugging Face Hub). A MoELayer built
with `moe_config_from_transformers` then runs on the recorded input; the table shows how far its
output is from the block's.

    pip install -e ".[test]"     # torch (CPU) and transformers
    python examples/from_hf.py
"""
import argparse
import os
import tempfile

import numpy as np

FAMILIES = ("deepseek_v3", "deepseek_v2", "qwen3_moe", "qwen2_moe", "mixtral")
MOE_BLOCKS = ("DeepseekV3MoE", "DeepseekV2Moe", "Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock",
              "MixtralSparseMoeBlock")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--layers", type=int, default=2, help="decoder layers (each with a MoE block)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def tiny_model(family, layers):
    """A transformers causal LM of the family: hidden size 32, 8 routed experts, top-2."""
    import transformers

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2)
    deepseek = dict(moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                    topk_group=2, first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16,
                    qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=4)
    if family == "deepseek_v3":
        config = transformers.DeepseekV3Config(**{**common, **deepseek}, n_shared_experts=1,
                                               routed_scaling_factor=2.5)
        return transformers.DeepseekV3ForCausalLM(config)
    if family == "deepseek_v2":
        config = transformers.DeepseekV2Config(**{**common, **deepseek}, n_shared_experts=2,
                                               topk_method="group_limited_greedy",
                                               routed_scaling_factor=1.5)
        return transformers.DeepseekV2ForCausalLM(config)
    qwen = dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, head_dim=8)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, **qwen, norm_topk_prob=True)
        return transformers.Qwen3MoeForCausalLM(config)
    if family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**common, **qwen, shared_expert_intermediate_size=24)
        return transformers.Qwen2MoeForCausalLM(config)
    config = transformers.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def randomise_routers(model, rng):
    """Router weights large enough that no routing choice is a near tie (transformers' small
    initialisation leaves many tokens with experts a rounding error apart), and a non-zero
    DeepSeek-V3 selection bias."""
    import torch

    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("mlp.gate.weight"):
                tensor.copy_(torch.from_numpy(rng.normal(0, 0.5, tuple(tensor.shape))))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.from_numpy(rng.normal(0, 0.05, tuple(tensor.shape))))


def record_moe_blocks(model, ids):
    """{block name: (input, output)} of every MoE block for one forward pass on ids."""
    import torch

    records, hooks = {}, []
    for name, module in model.named_modules():
        if type(module).__name__ in MOE_BLOCKS:
            def hook(module_, args, output, name=name):
                records[name] = (args[0].detach().numpy().copy(), output.detach().numpy().copy())
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        model(torch.from_numpy(ids))
    for h in hooks:
        h.remove()
    return records


def hub_state_dict(model):
    """The per-expert checkpoint save_pretrained writes, as numpy arrays."""
    from safetensors.numpy import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return load_file(os.path.join(tmp, "model.safetensors"))


def main(argv=None):
    args = parse_args(argv)
    import mindspore as ms
    import torch
    from mindspore import Parameter, Tensor

    import ms_moe_ops

    ms.set_device("CPU")
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    print(f"{'family':<12} {'block':<20} {'layout':<10} {'max|out|':>9} {'max|diff|':>10} "
          f"{'relative':>9}")
    worst = 0.0
    for family in args.families:
        model = tiny_model(family, args.layers).float().eval()
        randomise_routers(model, rng)
        ids = rng.integers(0, model.config.vocab_size, (args.batch_size, args.seq_len))
        records = record_moe_blocks(model, ids)
        config = ms_moe_ops.moe_config_from_transformers(model.config)
        layouts = {"fused": {k: v.numpy() for k, v in model.state_dict().items()},
                   "per-expert": hub_state_dict(model)}
        for block, (x, expected) in records.items():
            for layout, state in layouts.items():
                prefix = block + "."
                if family == "mixtral" and layout == "per-expert":  # the Hub's name of the block
                    prefix = prefix.replace(".mlp.", ".block_sparse_moe.")
                params = ms_moe_ops.convert_moe_checkpoint(state, prefix, "", family)
                layer = ms_moe_ops.MoELayer(config)
                # the converted weights, and the layer's own routing statistics (zeros: no token
                # routed yet), which a checkpoint does not hold: a complete load warns of nothing
                params.update({name: p.asnumpy() for name, p in layer.parameters_and_names()
                               if name not in params})
                ms.load_param_into_net(layer, {k: Parameter(Tensor(v), name=k)
                                               for k, v in params.items()}, strict_load=True)
                out = layer(Tensor(x)).asnumpy()
                diff = float(np.abs(out - expected).max())
                scale = float(np.abs(expected).max())
                worst = max(worst, diff / max(scale, 1e-30))
                print(f"{family:<12} {block:<20} {layout:<10} {scale:>9.2e} {diff:>10.2e} "
                      f"{diff / max(scale, 1e-30):>9.2e}")
    print(f"largest difference relative to the block's output: {worst:.2e}")
    return worst


if __name__ == "__main__":
    main()
