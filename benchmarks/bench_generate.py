"""Decoding speed with the KV cache: ms_moe_ops.models.generate (GRAPH mode, one compiled decode
step) side by side with transformers' `generate` (torch, CPU, its dynamic KV cache) on the same
weights: a Qwen3-MoE-like model of realistic width (2 layers, hidden 1024, 16 experts of 512,
top-2, 16 heads / 4 key-value heads of 64) with random weights, made by transformers, written
with save_pretrained and converted with ms_moe_ops.convert.

Decode tokens/s = batch x (new tokens - 1) / the time from the first new token to the last (the
prompt's pass and the compilations excluded), greedy, no eos, for batch 1 and batch 8, each side
run in turns (the median of --repeats rounds); then ms_moe_ops with its routed experts quantised
(int8: W8A8, calibrated on 8 random prompts; w8a16), against transformers' float32 rate. Then
the time per token along one long generation, in windows of positions: flat for a static cache.

    OMP_NUM_THREADS=2 python benchmarks/bench_generate.py

OpenMP's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, unless set otherwise), as in the generate
command, for both sides.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

# as `python -m ms_moe_ops.generate` runs (its _sleeping_openmp), for both sides: torch, MindSpore
# and the kernels share one libgomp, which reads it when it loads (nothing has yet)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


QUANT_MODES = ("int8", "w8a16")


def hf_config(a):
    import transformers
    return transformers.Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        moe_intermediate_size=a.ffn, num_experts=a.experts, num_experts_per_tok=a.top_k,
        norm_topk_prob=True, max_position_embeddings=4096, bos_token_id=None,
        eos_token_id=None)


class Clock:
    """Times of each step's tokens (a transformers streamer, and a generate() streamer)."""

    def __init__(self):
        self.times = []

    def put(self, _value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    __call__ = put


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch's threads")
    p.add_argument("--long", type=int, default=512, help="new tokens of the per-position run (0: none)")
    a = p.parse_args(argv)

    import mindspore as ms
    import torch
    import transformers
    from ms_moe_ops.convert import convert_checkpoint, load_pretrained
    from ms_moe_ops import quantize
    from ms_moe_ops.models import DecodeStep, generate

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    work = tempfile.mkdtemp(prefix="bench_generate-")
    try:
        model = transformers.AutoModelForCausalLM.from_config(hf_config(a)).float().eval()
        model.save_pretrained(os.path.join(work, "hf"))
        convert_checkpoint(os.path.join(work, "hf"), os.path.join(work, "ms"))
        net = load_pretrained(os.path.join(work, "ms"))
        quantised = {mode: load_pretrained(os.path.join(work, "ms")) for mode in QUANT_MODES}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"Qwen3-MoE-like: {a.layers} layers, H={a.hidden}, {a.experts} experts of {a.ffn} "
          f"(top-{a.top_k}), vocab {a.vocab}; float32; prompt {a.prompt}, {a.new} new tokens; "
          f"torch on {a.threads} thread(s), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")

    def ours(ids, new, step, model=net):
        clock = Clock()
        tokens = generate(model, ids, new, streamer=clock, step=step)
        return tokens, clock.times

    def theirs(ids, new):
        clock = Clock()
        with torch.no_grad():
            tokens = model.generate(torch.from_numpy(ids), max_new_tokens=new,
                                    min_new_tokens=new, do_sample=False, use_cache=True,
                                    attention_mask=torch.ones(ids.shape, dtype=torch.long),
                                    streamer=clock, pad_token_id=0).numpy()
        return tokens, clock.times[1:]  # the first put is the prompt

    rng = np.random.default_rng(0)
    for mode, qnet in quantised.items():  # calibrated on prompts of the benchmark's shape
        calibration = [ms.Tensor(rng.integers(0, a.vocab, (8, a.prompt)).astype(np.int32))]
        quantize(qnet, mode, calibration=calibration if mode == "int8" else None)
    float_rates = {}
    for batch in (1, 8):
        ids = rng.integers(0, a.vocab, (batch, a.prompt))
        step = DecodeStep(net)
        mine, _ = ours(ids, a.new, step)  # compiles the prompt's and the decode step's graphs
        reference, _ = theirs(ids, a.new)
        same = (mine == reference).mean()
        rates = {"ms_moe_ops": [], "transformers": []}
        for _ in range(a.repeats):
            for name, fn in (("ms_moe_ops", lambda: ours(ids, a.new, step)),
                             ("transformers", lambda: theirs(ids, a.new))):
                _, times = fn()
                rates[name].append(batch * (len(times) - 1) / (times[-1] - times[0]))
        r = {k: statistics.median(v) for k, v in rates.items()}
        float_rates[batch] = r
        print(f"batch {batch}: decode {r['ms_moe_ops']:8.1f} tokens/s (ms_moe_ops, GRAPH), "
              f"{r['transformers']:8.1f} tokens/s (transformers); ratio "
              f"{r['ms_moe_ops'] / r['transformers']:.2f}x; same greedy tokens: {same:.0%}")

    for mode, qnet in quantised.items():  # routed experts quantised (ms_moe_ops.quantize)
        for batch in (1, 8):
            ids = rng.integers(0, a.vocab, (batch, a.prompt))
            step = DecodeStep(qnet)
            ours(ids, a.new, step, qnet)  # compiles
            rates = []
            for _ in range(a.repeats):
                _, times = ours(ids, a.new, step, qnet)
                rates.append(batch * (len(times) - 1) / (times[-1] - times[0]))
            rate, theirs_rate = statistics.median(rates), float_rates[batch]["transformers"]
            print(f"batch {batch}, {mode} experts: decode {rate:8.1f} tokens/s (ms_moe_ops, "
                  f"GRAPH), {rate / theirs_rate:.2f}x transformers' float32")

    if a.long < 2:  # (--long 0: no per-position run)
        return 0
    ids = rng.integers(0, a.vocab, (1, 16))
    step = DecodeStep(net)
    _, times = ours(ids, a.long, step)
    _, times = ours(ids, a.long, step)
    _, their_times = theirs(ids, a.long)
    print(f"time per token along one generation of {a.long} tokens (batch 1, prompt 16; "
          f"ms_moe_ops' cache holds {16 + a.long} positions from the start):")
    width = a.long // 4
    for lo in range(0, a.long - 1, width):
        hi = min(lo + width, a.long - 1)
        mine = np.median(np.diff(times[lo:hi + 1])) * 1e3
        other = np.median(np.diff(their_times[lo:hi + 1])) * 1e3
        print(f"  positions {16 + lo:5d}-{16 + hi:5d}: {mine:7.2f} ms (ms_moe_ops)  "
              f"{other:7.2f} ms (transformers)")


if __name__ == "__main__":
    sys.exit(main())
