"""Fine-tune a transformers DeepSeek-V3 checkpoint in MindSpore and hand it back to transformers.

1. A checkpoint: a small DeepSeek-V3 (byte-level vocabulary of 256, multi-head latent attention,
   a dense first layer, then MoE layers with a shared expert and the sigmoid group-limited
   router) made by transformers with random weights and written with save_pretrained, as the
   Hub's checkpoints are (or --hf DIR: a DeepSeek-V3 checkpoint directory of your own whose
   vocabulary starts with the 256 bytes).
2. Converted with ms_moe_ops.convert (what `python -m ms_moe_ops.convert SRC DST` does) and
   loaded into ms_moe_ops.models.MoECausalLM.
3. Fine-tuned in GRAPH mode on the Python documentation that ships with Python
   (pydoc_data.topics, as bytes; nothing is downloaded), Adam with a cosine schedule, and
   DeepSeek-V3's auxiliary-loss-free balancing: after every step `update_expert_bias` moves each
   router's selection bias towards the experts that got fewer tokens.
4. The loss curve (loss.png), the MindSpore checkpoint (finetuned.safetensors), then the export
   to transformers' layout (hf/), which transformers loads: its loss on the validation text and
   its greedy continuation of a prompt are compared with ours.

    python examples/finetune_deepseek.py                  # about 2 minutes on 2 CPU cores
    python examples/finetune_deepseek.py --steps 50 --out runs/quick
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_moe import cosine_schedule, plot_losses  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hf", help="a DeepSeek-V3 checkpoint directory to start from (default: "
                                "make a small one with random weights)")
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence")
    p.add_argument("--layers", type=int, default=3, help="decoder layers (the first dense)")
    p.add_argument("--hidden", type=int, default=128, help="model width")
    p.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--bias-update-rate", type=float, default=5e-3,
                   help="aux-loss-free balancing: expert-bias step per training step (0 = off)")
    p.add_argument("--eval-every", type=int, default=50, help="validation interval (steps)")
    p.add_argument("--mode", choices=("graph", "pynative"), default="graph")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/finetune", help="output directory")
    return p.parse_args(argv)


class ByteText:
    """pydoc_data.topics as bytes (token id = byte): 90% to train, 10% to validate."""

    def __init__(self):
        from pydoc_data.topics import topics

        ids = np.frombuffer("\n\n".join(topics[k] for k in sorted(topics)).encode(), np.uint8)
        split = int(len(ids) * 0.9)
        self.train, self.val = ids[:split].astype(np.int32), ids[split:].astype(np.int32)

    def batch(self, split, batch_size, length, rng):
        ids = self.train if split == "train" else self.val
        start = rng.integers(0, len(ids) - length, batch_size)
        return ids[start[:, None] + np.arange(length)]


def make_checkpoint(path, args):
    """A small DeepSeek-V3 with transformers' own initialisation, written by save_pretrained."""
    import torch
    import transformers

    torch.manual_seed(args.seed)
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=args.hidden // 2, kv_lora_rank=args.hidden // 4, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k, n_group=2, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.5, max_position_embeddings=4 * args.seq_len,
        bos_token_id=None, eos_token_id=None)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(path)


def main(argv=None):
    args = parse_args(argv)
    import mindspore as ms
    from mindspore import Tensor, nn
    from tqdm import tqdm

    import ms_moe_ops
    from ms_moe_ops.convert import convert_checkpoint, export_checkpoint, load_pretrained
    from ms_moe_ops.models import CausalLMLoss, generate

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE)
    ms.set_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    os.makedirs(args.out, exist_ok=True)
    data = ByteText()

    # 1-2: the transformers checkpoint, converted and loaded
    source = args.hf or os.path.join(args.out, "source")
    if args.hf is None:
        make_checkpoint(source, args)
    converted = os.path.join(args.out, "ms")
    report = convert_checkpoint(source, converted, overwrite=True)
    net = load_pretrained(converted, bias_update_rate=args.bias_update_rate)
    params = sum(int(np.prod(p.shape)) for p in net.trainable_params())
    print(f"{source} -> {converted}: {report['tensors']} tensors; {net.config.num_layers} layers "
          f"({len(net.config.moe_layers)} MoE, {net.config.moe.num_experts} experts top-"
          f"{net.config.moe.top_k} + {net.config.moe.n_shared_experts} shared), "
          f"{params / 1e6:.2f}M parameters; {args.mode} mode")

    # 3: fine-tuning
    loss_fn = CausalLMLoss(net)
    optimizer = nn.Adam(net.trainable_params(),
                        learning_rate=Tensor(cosine_schedule(args.lr, args.steps)))
    step = nn.TrainOneStepCell(loss_fn, optimizer)
    step.set_train()
    val_batch = data.batch("val", args.batch_size, args.seq_len, np.random.default_rng(1))

    def val_loss():
        value = float(loss_fn(Tensor(val_batch)).asnumpy())
        ms_moe_ops.reset_expert_load(net)  # evaluation tokens do not steer the balancing
        return value

    losses, loads, val_points = [], [], [(0, val_loss())]
    start = time.time()
    bar = tqdm(range(args.steps), desc="fine-tune", unit="step", dynamic_ncols=True)
    for i in bar:
        losses.append(float(step(Tensor(data.batch("train", args.batch_size, args.seq_len,
                                                   rng))).asnumpy()))
        loads.append(ms_moe_ops.update_expert_bias(net))
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            val_points.append((i + 1, val_loss()))
        bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}", val=f"{val_points[-1][1]:.3f}",
                        imbalance=f"{max(ms_moe_ops.load_imbalance(loads[-1])):.2f}")
    elapsed = time.time() - start
    window = max(1, min(20, args.steps // 5))
    loads = np.stack(loads)
    head = [f"{v:.2f}" for v in ms_moe_ops.load_imbalance(loads[:window].sum(0))]
    tail = [f"{v:.2f}" for v in ms_moe_ops.load_imbalance(loads[-window:].sum(0))]
    print(f"\n{args.steps} steps in {elapsed:.1f} s: train loss {np.mean(losses[:window]):.3f} -> "
          f"{np.mean(losses[-window:]):.3f} (mean of {window} steps), validation "
          f"{val_points[0][1]:.3f} -> {val_points[-1][1]:.3f} (uniform guess {np.log(256):.3f})")
    print(f"load imbalance (max/mean tokens per expert, per MoE layer): first {window} steps "
          f"{head} -> last {window} steps {tail}")
    plot_losses(losses, val_points, os.path.join(args.out, "loss.png"))
    saved = os.path.join(args.out, "finetuned.safetensors")
    ms.save_checkpoint(net, saved, format="safetensors")

    # 4: back to transformers
    exported = os.path.join(args.out, "hf")
    export_checkpoint(saved, exported, reference=converted, overwrite=True)
    print(f"wrote {os.path.join(args.out, 'loss.png')}, {saved} and {exported} (transformers)")
    ours, theirs = compare_with_transformers(exported, net, val_batch, data, generate)
    return {"train_loss": losses, "val": val_points, "ours": ours, "transformers": theirs}


def compare_with_transformers(exported, net, val_batch, data, generate):
    """transformers loads the export: its validation loss and greedy continuation beside ours."""
    import torch
    import transformers
    from mindspore import Tensor

    from ms_moe_ops.models import CausalLMLoss

    model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    ids = torch.from_numpy(val_batch.astype(np.int64))
    with torch.no_grad():
        theirs = float(model(ids, labels=ids).loss)
    ours = float(CausalLMLoss(net)(Tensor(val_batch)).asnumpy())
    print(f"\ntransformers loaded {exported} ({type(model).__name__}): validation loss "
          f"{theirs:.5f}, ours {ours:.5f}")
    prompt = np.frombuffer(b"The while statement is ", np.uint8).astype(np.int32)[None]
    start = prompt.shape[1]
    with torch.no_grad():
        their_text = model.generate(torch.from_numpy(prompt.astype(np.int64)), max_new_tokens=40,
                                    do_sample=False, attention_mask=torch.ones(prompt.shape,
                                                                               dtype=torch.long))
    our_text = generate(net, prompt, 40)
    decode = lambda ids: bytes(int(i) for i in ids).decode("ascii", "replace")  # noqa: E731
    print(f"prompt       {decode(prompt[0])!r}\ntransformers {decode(their_text[0, start:])!r}\n"
          f"ours         {decode(our_text[0, start:])!r}"
          f"  ({'the same' if np.array_equal(their_text.numpy(), our_text) else 'DIFFERENT'})")
    return ours, theirs


if __name__ == "__main__":
    main()
