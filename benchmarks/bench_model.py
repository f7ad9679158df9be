"""A whole MoE language model's training step: ms_moe_ops.models.MoECausalLM (GRAPH mode) side by
side with transformers' own model of the same checkpoint (torch, CPU), same weights, same tokens.

A DeepSeek-V3 (or --family qwen3_moe) of a few layers is made by transformers with its own random
initialisation and written with save_pretrained; ms_moe_ops.convert converts it and
load_pretrained loads it; the logits of the two are compared before anything is
timed. One training step = the next-token loss of a [batch, seq] token batch, its gradients
and an SGD update of every weight, on both sides:

- ms_moe_ops: `nn.TrainOneStepCell(CausalLMLoss(net), nn.SGD(...))`, GRAPH mode;
- transformers: `model(ids, labels=ids).loss.backward(); optimizer.step()` with
  `torch.optim.SGD`, its default experts (a Python loop over the experts that got tokens) and
  SDPA attention, on every core (`torch.set_num_threads`); and its "grouped_mm" experts when
  torch has them on CPU.

Timings are medians of rounds in which each contender runs once, in turns.

    python benchmarks/bench_model.py                       # DeepSeek-V3, 4 layers, H=512, 16 experts
    python benchmarks/bench_model.py --family qwen3_moe --experts 64 --top-k 8
"""
import argparse
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cores, timed_together  # noqa: E402

# the kernels' OpenMP threads, as the process started (MindSpore sets it to 1 once imported)
KERNEL_THREADS = os.environ.get("OMP_NUM_THREADS", "every core")


def hf_config(a):
    import transformers

    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                  num_hidden_layers=a.layers, num_attention_heads=a.heads,
                  num_experts_per_tok=a.top_k, max_position_embeddings=max(4096, a.seq_len),
                  bos_token_id=None, eos_token_id=None)
    if a.family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common, num_key_value_heads=a.heads, moe_intermediate_size=a.ffn,
            n_routed_experts=a.experts, n_group=4, topk_group=2, n_shared_experts=1,
            first_k_dense_replace=1, q_lora_rank=a.hidden // 2, kv_lora_rank=a.hidden // 4,
            qk_nope_head_dim=a.hidden // a.heads, qk_rope_head_dim=a.hidden // a.heads // 2,
            v_head_dim=a.hidden // a.heads, routed_scaling_factor=2.5)
    return transformers.Qwen3MoeConfig(**common, num_key_value_heads=max(1, a.heads // 4),
                                       head_dim=a.hidden // a.heads, moe_intermediate_size=a.ffn,
                                       num_experts=a.experts, norm_topk_prob=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=("deepseek_v3", "qwen3_moe"), default="deepseek_v3")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=256, help="moe_intermediate_size")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None,
                   help="torch's threads (default: every core); give the kernels as many with "
                        "OMP_NUM_THREADS=N on the command line")
    p.add_argument("--pynative", action="store_true", help="also MoECausalLM in PyNative mode")
    a = p.parse_args(argv)

    import mindspore as ms
    from mindspore import Tensor, nn
    import torch
    import transformers

    from ms_moe_ops.convert import convert_checkpoint, load_pretrained
    from ms_moe_ops.models import CausalLMLoss

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    threads = a.threads or cores()
    torch.set_num_threads(threads)  # MindSpore set OMP_NUM_THREADS=1 when it was imported
    torch.manual_seed(0)
    work = tempfile.mkdtemp(prefix="bench_model-")
    try:
        model = transformers.AutoModelForCausalLM.from_config(hf_config(a)).float()
        model.save_pretrained(os.path.join(work, "hf"))
        convert_checkpoint(os.path.join(work, "hf"), os.path.join(work, "ms"))
        net = load_pretrained(os.path.join(work, "ms"))
        theirs = {"transformers (torch)": model}
        try:
            grouped = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.join(work, "hf"), experts_implementation="grouped_mm").float()
            ids = torch.zeros(1, 8, dtype=torch.long)
            grouped(ids, labels=ids).loss.backward()
            theirs["transformers, grouped_mm experts"] = grouped
        except Exception as err:  # pylint: disable=broad-except
            print(f"(grouped_mm experts do not run here: {type(err).__name__}: {err})")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rng = np.random.default_rng(0)
    ids = rng.integers(0, a.vocab, (a.batch, a.seq_len))
    ids_ms, ids_torch = Tensor(ids.astype(np.int32)), torch.from_numpy(ids)
    with torch.no_grad():
        reference = model(ids_torch).logits.numpy()
    error = np.abs(net(ids_ms).asnumpy() - reference).max() / np.abs(reference).max()
    params = sum(int(np.prod(q.shape)) for q in net.trainable_params())
    tokens = a.batch * a.seq_len
    print(f"{a.family}: {a.layers} layers ({len(net.config.moe_layers)} MoE), H={a.hidden}, "
          f"{a.experts} experts of {a.ffn} (top-{a.top_k}), vocab {a.vocab}; "
          f"{params / 1e6:.1f}M parameters; batch "
          f"{a.batch} x {a.seq_len} tokens; float32, {cores()} cores, torch on {threads} "
          f"thread(s), the kernels on {KERNEL_THREADS}")
    print(f"max relative logit error against transformers: {error:.1e}")

    lr = 1e-4
    step = nn.TrainOneStepCell(CausalLMLoss(net), nn.SGD(net.trainable_params(), learning_rate=lr))
    step.set_train()
    contenders = [("ms_moe_ops MoECausalLM (GRAPH)", lambda: step(ids_ms).asnumpy())]
    for name, m in theirs.items():
        contenders.append((name, torch_step(m, torch.optim.SGD(m.parameters(), lr=lr), ids_torch)))
    if a.pynative:
        def pynative():
            ms.set_context(mode=ms.PYNATIVE_MODE)
            try:
                return step(ids_ms).asnumpy()
            finally:
                ms.set_context(mode=ms.GRAPH_MODE)
        contenders.append(("ms_moe_ops MoECausalLM (PyNative)", pynative))
    times = timed_together(contenders, repeat=a.repeats)
    ours = contenders[0][0]
    print(f"\ntraining step (loss, gradients, SGD update), median of {a.repeats} rounds")
    print(f"  {'contender':<40} {'ms':>9} {'tokens/s':>9}  {'ms_moe_ops is':>14}")
    for name, sec in times.items():
        ratio = "" if name == ours else f"{sec / times[ours]:.2f}x faster"
        print(f"  {name:<40} {sec * 1e3:9.1f} {tokens / sec:9.0f}  {ratio:>14}")
    return times


def torch_step(model, optimizer, ids):
    model.train()

    def run():
        optimizer.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    return run


if __name__ == "__main__":
    main()
