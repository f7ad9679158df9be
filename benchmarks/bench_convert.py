"""ms_moe_ops.convert against a plain read of the same checkpoint: MB/s, and the peak resident
memory of a conversion against the checkpoint's size and its largest block.

A Qwen3-MoE-shaped transformers checkpoint (config.json and one safetensors shard per decoder
layer, the Hub's per-expert layout, bfloat16 when torch is there to write it, else float32) is
generated with random weights, several times larger than one MoE block. Then, in turns:

- plain read: every shard read whole with safetensors' own `load_file` (what loading a checkpoint
  costs before any conversion; torch's maps the file, so each tensor is copied out of the map);
  and the files' bytes read into one reused buffer (the disk or page cache alone);
- convert_checkpoint: the same shards to MindSpore safetensors (float32, MoE blocks as MoELayer
  parameters).

The files are read once before timing, so every contender reads from the page cache (a cold
disk would slow all alike). MB/s are the source's bytes per second. Peak RSS is the largest
resident set during the call above the resident set before it (Linux: /proc/self/status VmHWM,
reset through /proc/self/clear_refs).

    python benchmarks/bench_convert.py                       # ~420 MB of bfloat16, 8 layers
    python benchmarks/bench_convert.py --layers 16 --experts 64
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import timed_together  # noqa: E402


def qwen3_moe_config(a):
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
            "vocab_size": a.vocab, "hidden_size": a.hidden, "intermediate_size": 2 * a.hidden,
            "num_hidden_layers": a.layers, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": a.hidden // 8, "moe_intermediate_size": a.ffn, "num_experts": a.experts,
            "num_experts_per_tok": 4, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096, "tie_word_embeddings": False, "mlp_only_layers": [],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}


def hub_tensors(config):
    """{name: shape} of the checkpoint in the Hub's per-expert layout, grouped by layer."""
    from ms_moe_ops.convert._layout import block_tensors
    from ms_moe_ops.models import CausalLMConfig

    cfg = CausalLMConfig.from_transformers(config)
    shapes = {}
    for name, shape in cfg.parameter_shapes().items():
        if ".mlp." not in name:
            shapes[name] = shape
    for layer in cfg.moe_layers:
        for _, tensors in block_tensors(cfg.moe, cfg.family, "per-expert"):
            for rel, shape in tensors:
                shapes[f"model.layers.{layer}.mlp.{rel}"] = shape
    return shapes


def generate(path, a, seed=0):
    """The checkpoint at path: one shard per layer (the embeddings and head in the first and
    last), random normal weights. Returns (total bytes, largest MoE block's bytes)."""
    os.makedirs(path, exist_ok=True)
    config = qwen3_moe_config(a)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    shapes = hub_tensors(config)
    rng = np.random.default_rng(seed)
    files = [f"model-{i + 1:05d}-of-{a.layers:05d}.safetensors" for i in range(a.layers)]

    def shard_of(name):
        if name.startswith("model.layers."):
            return int(name.split(".")[2])
        return 0 if "embed" in name else a.layers - 1
    weight_map, total, block = {}, 0, 0
    for i, file in enumerate(files):
        names = [n for n in shapes if shard_of(n) == i]
        tensors = {n: rng.standard_normal(shapes[n], np.float32) for n in names}
        block = max(block, sum(v.nbytes for n, v in tensors.items() if ".mlp." in n))
        total += _save(tensors, os.path.join(path, file), a.dtype)
        weight_map.update({n: file for n in names})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    itemsize = 2 if a.dtype == "bfloat16" else 4
    return total, block * itemsize // 4


def _save(tensors, file, dtype):
    if dtype == "bfloat16":
        import torch
        from safetensors.torch import save_file

        save_file({n: torch.from_numpy(v).bfloat16() for n, v in tensors.items()}, file,
                  {"format": "pt"})
    else:
        from safetensors.numpy import save_file

        save_file(tensors, file, {"format": "pt"})
    return os.path.getsize(file)


# -- measurements ---------------------------------------------------------------------------------

def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_rss_above_start(fn):
    """(fn(), the largest resident set during fn minus the resident set before it, in bytes):
    Linux only (the peak is reset through /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _status("VmRSS")
    result = fn()
    return result, _status("VmHWM") - start


def plain_load(path, dtype):
    """Every shard whole, with safetensors' own loader (torch's maps the file: each tensor is
    copied, which reads it; numpy's copies by itself)."""
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            file = os.path.join(path, name)
            if dtype == "bfloat16":
                from safetensors.torch import load_file
                tensors = {k: v.clone() for k, v in load_file(file).items()}
            else:
                from safetensors.numpy import load_file
                tensors = load_file(file)
            del tensors


def raw_read(path, chunk=64 << 20):
    """The files' bytes into one reused buffer."""
    buffer = bytearray(chunk)
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass


def measure(a, workdir, repeat=3, show=print):
    """Generates the checkpoint, times the contenders and measures peak RSS; returns a dict."""
    from ms_moe_ops.convert import convert_checkpoint

    src = os.path.join(workdir, "hf")
    total, block = generate(src, a)
    show(f"checkpoint: {a.layers} layers, {a.experts} experts of {a.hidden}x{a.ffn}, {a.dtype}: "
         f"{total / 2**20:.1f} MiB in {a.layers} shards; largest MoE block {block / 2**20:.1f} "
         f"MiB ({block * 4 / 2**20 / (2 if a.dtype == 'bfloat16' else 4):.1f} MiB as float32)")
    count = [0]

    def convert():
        count[0] += 1
        dst = os.path.join(workdir, f"ms{count[0]}")
        convert_checkpoint(src, dst)
        shutil.rmtree(dst)
    raw_read(src)  # into the page cache
    times = timed_together([("raw read", lambda: raw_read(src)),
                            ("safetensors load_file", lambda: plain_load(src, a.dtype)),
                            ("ms_moe_ops convert_checkpoint", convert)], repeat=repeat)
    _, peak_convert = peak_rss_above_start(convert)
    _, peak_load = peak_rss_above_start(lambda: plain_load(src, a.dtype))
    show(f"\n  {'contender':<32} {'s':>7} {'MB/s':>8}")
    for name, sec in times.items():
        show(f"  {name:<32} {sec:7.2f} {total / 1e6 / sec:8.0f}")
    ratio = times["ms_moe_ops convert_checkpoint"] / times["safetensors load_file"]
    show(f"\nconvert_checkpoint takes {ratio:.2f}x the time of safetensors' load_file of the "
         f"same shards (and writes {2 if a.dtype == 'bfloat16' else 1}x the bytes, as float32)")
    block32 = block * 4 // (2 if a.dtype == "bfloat16" else 4)
    show(f"peak RSS above the start: convert_checkpoint {peak_convert / 2**20:.1f} MiB "
         f"({peak_convert / total:.2f}x the checkpoint, {peak_convert / block32:.2f}x its largest "
         f"block as float32); load_file of one shard after another {peak_load / 2**20:.1f} MiB")
    return {"total": total, "block": block, "block32": block32, "times": times,
            "peak_convert": peak_convert,
            "peak_load": peak_load}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=512, help="moe_intermediate_size")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="default: bfloat16 when torch is installed")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workdir", help="where to generate (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.dtype is None:
        try:
            import torch  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
            args.dtype = "bfloat16"
        except ImportError:
            args.dtype = "float32"
    return args


def main(argv=None):
    args = parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="bench_convert-")
    try:
        start = time.perf_counter()
        result = measure(args, work, args.repeat)
        print(f"({time.perf_counter() - start:.0f} s in all)")
        return result
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
