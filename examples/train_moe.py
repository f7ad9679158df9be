"""Train a small Mixture-of-Experts language model with ms_moe_ops.

A character-level decoder-only transformer (causal self-attention + MoELayer feed-forward blocks
with a shared expert) learns the Python documentation text that ships with Python itself
(`pydoc_data.topics`), in GRAPH mode, with DeepSeek-V3's auxiliary-loss-free load balancing
and, if asked, the auxiliary losses (Switch load balancing, sequence-wise balance, router z-loss).

    python examples/train_moe.py                      # ~4 minutes on 2 idle CPU cores
    python examples/train_moe.py --steps 50 --experts 16 --top-k 4 --out runs/e16
    python examples/train_moe.py --router softmax --aux-loss 0.01 --z-loss 0.001 --bias-update-rate 0
    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --log_dir=runs/msrun --join=True \
        examples/train_moe.py --expert-parallel 2    # the experts split over 2 processes

--model causal-lm trains an ms_moe_ops.models.MoECausalLM instead (DeepSeek-V3's architecture,
DeepSeek-V2's with --router softmax; one process) and also writes config.json and
model.safetensors, which `ms_moe_ops.convert.load_pretrained(out)` reads.

Writes to --out: the checkpoint (moe_lm.ckpt), chars.json (the vocabulary: a JSON list of the
characters, index = token id), loss.png (train/val loss), expert_load.png
(tokens per expert over time, per layer), and prints a summary and a sampled text. An --out that
holds an earlier run is kept: the run goes to the first free --out_2, --out_3, ... (--overwrite
replaces it).
"""
import argparse
import builtins
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_lm import MoELanguageModel, CharData  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=1000, help="training steps")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    p.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--shared-experts", type=int, default=1, help="always-on experts (0 = none)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=128, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--ffn", type=int, default=128, help="hidden width of each expert")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (Adam, cosine decay)")
    p.add_argument("--router", choices=("sigmoid", "softmax"), default="sigmoid",
                   help="score function of the routers")
    p.add_argument("--bias-update-rate", type=float, default=5e-3,
                   help="aux-loss-free balancing: expert-bias step per training step (0 = off)")
    p.add_argument("--aux-loss", type=float, default=0.0,
                   help="coefficient of the Switch load-balancing loss (0 = off)")
    p.add_argument("--seq-aux-loss", type=float, default=0.0,
                   help="coefficient of DeepSeek-V3's sequence-wise balance loss (0 = off)")
    p.add_argument("--z-loss", type=float, default=0.0,
                   help="coefficient of the router z-loss (0 = off)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="expert capacity: each expert takes at most ceil(T*K/E*C) of a step's "
                        "(token, slot) pairs, the rest are dropped (default: dropless)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="validation interval (steps; default: a tenth of the run, at most 100)")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches per evaluation")
    p.add_argument("--sample-chars", type=int, default=300, help="length of the sampled text")
    p.add_argument("--device", choices=("CPU", "Ascend"), default="CPU")
    p.add_argument("--mode", choices=("graph", "pynative"), default="graph")
    p.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="split every layer's experts over N processes (launch with msrun "
                        "--worker_num=N --local_worker_num=N); each trains on its own batches")
    p.add_argument("--model", choices=("moe-lm", "causal-lm"), default="moe-lm",
                   help="moe-lm: the small transformer of moe_lm.py; causal-lm: an "
                        "ms_moe_ops.models.MoECausalLM (DeepSeek-V3, or DeepSeek-V2 with "
                        "--router softmax), also saved as a directory load_pretrained reads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/moe_lm", help="output directory")
    p.add_argument("--overwrite", action="store_true",
                   help="write into --out even when it holds an earlier run")
    args = p.parse_args(argv)
    if args.eval_every is None:
        args.eval_every = min(100, max(1, args.steps // 10))
    return args


OUTPUTS = ("moe_lm.ckpt", "loss.png", "expert_load.png")


def output_dir(out, overwrite):
    """out, or when it holds an earlier run (and not overwrite) the first free out_2, out_3..."""
    def free(path):
        return not os.path.exists(path) or (os.path.isdir(path) and not any(
            name in OUTPUTS or name.startswith("moe_lm-rank") for name in os.listdir(path)))

    if overwrite or free(out):
        return out
    n = 2
    while not free(f"{out}_{n}"):
        n += 1
    return f"{out}_{n}"


def launched_by_msrun():
    """Whether this process is one of an msrun job (msrun gives each worker its role)."""
    return "MS_ROLE" in os.environ


def how_to_launch(n, argv):
    """The command that runs this script on n processes."""
    args = " ".join(argv)
    return (f"--expert-parallel {n} runs on {n} processes: launch it with msrun, e.g.\n"
            f"  msrun --worker_num={n} --local_worker_num={n} --master_port=8118 "
            f"--log_dir=runs/msrun --join=True {os.path.relpath(__file__)} {args}\n"
            f"(the first process's log, runs/msrun/worker_0.log, shows the progress)")


def main(argv=None):
    args = parse_args(argv)
    if args.model == "causal-lm" and args.expert_parallel > 1:
        raise SystemExit("--model causal-lm runs in one process (--expert-parallel 1)")
    if args.expert_parallel > 1 and not launched_by_msrun():
        raise SystemExit(how_to_launch(args.expert_parallel,
                                       sys.argv[1:] if argv is None else list(argv)))
    import mindspore as ms
    from mindspore import nn
    from tqdm import tqdm

    import ms_moe_ops
    from ms_moe_ops.parallel import ExpertParallelTrainStep

    ms.set_device(args.device)
    ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE)
    ep = start_expert_parallel(args.expert_parallel)
    rank = 0 if ep is None else ep.rank
    print = builtins.print if rank == 0 else (lambda *a, **k: None)  # one report: the first process
    ms.set_seed(args.seed)
    rng = np.random.default_rng(args.seed + rank)  # each process its own batches
    out = output_dir(args.out, args.overwrite)  # every process decides before any writes
    mean_over_ranks(0.0, ep)
    if out != args.out:
        print(f"{args.out} holds an earlier run: writing to {out} (--overwrite replaces it)")
    args.out = out
    os.makedirs(args.out, exist_ok=True)

    data = CharData()
    net = build_model(args, data, ep)
    # the router losses switched on, by their name in router.aux_losses
    losses_on = [name for name, coeff in (("switch", args.aux_loss), ("sequence", args.seq_aux_loss),
                                          ("z", args.z_loss)) if coeff]
    with_loss = nn.WithLossCell(net, nn.CrossEntropyLoss())
    lr = cosine_schedule(args.lr, args.steps)
    optimizer = nn.Adam(net.trainable_params(), learning_rate=ms.Tensor(lr, ms.float32))
    if ep is None:
        train_step = nn.TrainOneStepCell(with_loss, optimizer)
    else:  # gradients of the replicated weights averaged over the processes
        train_step = ExpertParallelTrainStep(with_loss, optimizer, ep)
    train_step.set_train()
    evaluate = nn.WithLossCell(net, nn.CrossEntropyLoss())  # same weights, forward only

    total, active = count_params(net, args)
    print(f"{args.layers} layers, d_model {args.d_model}, {args.experts} experts (top-{args.top_k}) "
          f"+ {args.shared_experts} shared, {args.router} router; {total / 1e6:.2f}M parameters, "
          f"{active / 1e6:.2f}M active per token; text: {len(data.train)} train / "
          f"{len(data.val)} val chars, vocabulary {data.vocab_size}; {args.mode} mode on "
          f"{args.device}" + (f"; experts split over {ep.size} processes" if ep else ""))
    if losses_on:
        print("router losses: " + ", ".join(f"{name} x {coeff:g}" for name, coeff in (
            ("switch", args.aux_loss), ("sequence", args.seq_aux_loss), ("z", args.z_loss))
            if coeff))

    def val_loss():
        losses = [float(evaluate(*tensors(data.batch("val", args.batch_size, args.seq_len, rng))))
                  for _ in range(args.eval_batches)]
        ms_moe_ops.reset_expert_load(net)  # evaluation tokens must not steer the balancing
        return mean_over_ranks(float(np.mean(losses)), ep)

    def tensors(batch):
        return ms.Tensor(batch[0], ms.int32), ms.Tensor(batch[1].reshape(-1), ms.int32)

    train_losses, loads, router_losses, dropped = [], [], [], []
    val_points = [(0, val_loss())]
    # per step, all processes
    tokens = args.batch_size * args.seq_len * (1 if ep is None else ep.size)
    start = time.time()
    first_step_time = None
    bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True, disable=rank != 0)
    for step in bar:
        t0 = time.time()
        loss = float(train_step(*tensors(data.batch("train", args.batch_size, args.seq_len, rng))))
        loss = mean_over_ranks(loss, ep)
        router_losses.append(router_loss_values(net))  # this step's, before any evaluation pass
        load = ms_moe_ops.update_expert_bias(net)  # tokens per expert of this step, then rebalance
        dropped.append(max(ms_moe_ops.dropped_fraction(net)))  # at the capacity, this step
        dt = time.time() - t0
        if first_step_time is None:
            first_step_time = dt  # includes the graph compilation
        train_losses.append(loss)
        loads.append(load)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val_points.append((step + 1, val_loss()))
        postfix = {"loss": f"{np.mean(train_losses[-10:]):.3f}",
                   "tok/s": f"{tokens / max(dt, 1e-9):.0f}",
                   "imbalance": f"{max(ms_moe_ops.load_imbalance(load)):.2f}"}
        if args.capacity_factor is not None:
            postfix["dropped"] = f"{dropped[-1]:.3f}"
        if val_points:
            postfix["val"] = f"{val_points[-1][1]:.3f}"
        for name in losses_on:
            postfix[name] = f"{router_losses[-1][name]:.3f}"
        bar.set_postfix(postfix)
    elapsed = time.time() - start
    loads = np.stack(loads)  # [steps, layers, experts]

    ckpt = os.path.join(args.out, "moe_lm.ckpt")
    save_checkpoint(net, ckpt, ep)
    if rank == 0:
        save_vocabulary(data, os.path.join(args.out, "chars.json"))
        if args.model == "causal-lm":
            net.save_pretrained(args.out)  # config.json, model.safetensors
        plot_losses(train_losses, val_points, os.path.join(args.out, "loss.png"))
        plot_expert_load(loads, os.path.join(args.out, "expert_load.png"))

    window = max(1, min(20, args.steps // 5))
    steady = (elapsed - first_step_time) / max(1, args.steps - 1)
    head_imb = [f"{v:.2f}" for v in ms_moe_ops.load_imbalance(loads[:window].sum(0))]
    tail_imb = [f"{v:.2f}" for v in ms_moe_ops.load_imbalance(loads[-window:].sum(0))]
    print("\n== summary ==")
    print(f"steps {args.steps}, {elapsed:.1f} s ({first_step_time:.1f} s first step with "
          f"compilation, then {tokens / steady:.0f} tokens/s)")
    print(f"train loss {np.mean(train_losses[:window]):.3f} -> {np.mean(train_losses[-window:]):.3f}"
          f" (mean of {window} steps); val loss {val_points[0][1]:.3f} (step {val_points[0][0]})"
          f" -> {val_points[-1][1]:.3f} (step {val_points[-1][0]}); a uniform guess scores "
          f"{np.log(data.vocab_size):.3f}")
    print(f"load imbalance (max/mean tokens per expert, per layer): first {window} steps "
          f"{head_imb} -> last {window} steps {tail_imb}")
    if args.capacity_factor is not None:
        print(f"pairs dropped at the experts' capacity (largest share over layers): first "
              f"{window} steps {np.mean(dropped[:window]):.3f} -> last {window} steps "
              f"{np.mean(dropped[-window:]):.3f}")
    if losses_on:  # with expert parallelism: the first process's tokens
        print("router losses (unscaled, mean over layers): " + ", ".join(
            f"{name} {np.mean([r[name] for r in router_losses[:window]]):.4f} -> "
            f"{np.mean([r[name] for r in router_losses[-window:]]):.4f}" for name in losses_on))
    print(f"wrote {ckpt}, {os.path.join(args.out, 'chars.json')}, "
          f"{os.path.join(args.out, 'loss.png')}, "
          f"{os.path.join(args.out, 'expert_load.png')}")

    prompt = data.val[:args.seq_len]
    text = net.sample(data, prompt, args.sample_chars, rng)  # on every process: each holds experts
    print("\n== sample (prompt from the validation text, then generated) ==")
    print(data.decode(prompt) + "|" + text)
    return {"train_loss": train_losses, "val": val_points, "loads": loads, "elapsed": elapsed,
            "router_losses": router_losses, "net": net}


def router_loss_values(net):
    """{"switch", "sequence", "z"}: the unscaled router losses of the last forward pass, mean
    over the MoE layers."""
    import ms_moe_ops

    values = [layer.router.losses() for layer in ms_moe_ops.moe_layers(net)]
    return {name: float(np.mean([v[name] for v in values])) for name in values[0]}


def start_expert_parallel(n):
    """The ExpertParallel of this msrun-launched process (None for n = 1)."""
    if n == 1:
        return None
    from mindspore.communication import init
    from ms_moe_ops.parallel import ExpertParallel

    init()
    ep = ExpertParallel()
    if ep.size != n:
        raise SystemExit(f"--expert-parallel {n}, but msrun started {ep.size} processes "
                         f"(--worker_num={n} --local_worker_num={n})")
    return ep


def build_model(args, data, ep):
    """The language model; with expert parallelism this process's share of it, starting from
    the same weights as one process would (its experts cut out of them)."""
    import mindspore as ms
    from ms_moe_ops.parallel import shard_experts

    moe = moe_config(args)
    if args.model == "causal-lm":
        from moe_lm import CharCausalLM, causal_lm_config

        config = causal_lm_config(data.vocab_size, args.seq_len, args.heads, args.layers, moe)
        return CharCausalLM(config, args.seq_len, **moe_overrides(args))

    def model(expert_parallel=None):
        return MoELanguageModel(data.vocab_size, args.seq_len, args.heads, args.layers, moe,
                                expert_parallel)

    net = model()
    if ep is None:
        return net
    part = model(ep)
    ms.load_param_into_net(part, shard_experts(net.parameters_dict(), ep.rank, ep.size))
    return part


def moe_overrides(args):
    """The MoEConfig options of the flags that a transformers configuration does not hold."""
    return dict(bias_update_rate=args.bias_update_rate, aux_loss_coeff=args.aux_loss,
                seq_aux_loss_coeff=args.seq_aux_loss, z_loss_coeff=args.z_loss,
                capacity_factor=args.capacity_factor)


def moe_config(args):
    """The MoEConfig of every block's MoE layer, from the flags."""
    from ms_moe_ops import MoEConfig

    return MoEConfig(args.d_model, args.ffn, args.experts, args.top_k,
                     n_shared_experts=args.shared_experts, score_func=args.router,
                     bias_update_rate=args.bias_update_rate, aux_loss_coeff=args.aux_loss,
                     seq_aux_loss_coeff=args.seq_aux_loss, z_loss_coeff=args.z_loss,
                     capacity_factor=args.capacity_factor)


def mean_over_ranks(value, ep):
    """The mean of a float over the processes (also a barrier); value itself in one process."""
    if ep is None:
        return value
    import mindspore as ms

    total = ms.ops.AllReduce(group=ep.group)(ms.Tensor([value], ms.float32))
    return float(total.asnumpy()[0]) / ep.size


def save_checkpoint(net, path, ep):
    """The whole model at path. With expert parallelism every process writes its part
    (moe_lm-rank<r>.ckpt) and the first joins them into a checkpoint one process loads."""
    import mindspore as ms

    if ep is None:
        ms.save_checkpoint(net, path)
        return
    from ms_moe_ops.parallel import gather_experts

    part = path.replace(".ckpt", "-rank{}.ckpt")
    ms.save_checkpoint(net, part.format(ep.rank))
    mean_over_ranks(0.0, ep)  # every part written
    if ep.rank == 0:
        full = gather_experts([ms.load_checkpoint(part.format(r)) for r in range(ep.size)])
        ms.save_checkpoint([{"name": k, "data": v} for k, v in full.items()], path)


def save_vocabulary(data, path):
    """The character vocabulary as a JSON list (index = token id), for reading the model's ids
    back as text."""
    import json

    with open(path, "w", encoding="utf-8") as f:
        json.dump(data.chars, f)


def cosine_schedule(peak, steps, warmup_frac=0.05):
    warmup = max(1, int(steps * warmup_frac))
    s = np.arange(steps, dtype=np.float64)
    lr = np.where(s < warmup, peak * (s + 1) / warmup,
                  0.1 * peak + 0.9 * peak * 0.5 * (1 + np.cos(np.pi * (s - warmup) / max(1, steps - warmup))))
    return lr.astype(np.float32)


def count_params(net, args):
    """(parameters, parameters active per token) of the whole model (all processes)."""
    total = sum(int(np.prod(p.shape)) for p in net.trainable_params())
    routed = sum(int(np.prod(p.shape)) for p in net.trainable_params() if ".experts." in p.name)
    routed *= args.expert_parallel  # each process holds 1/N of the experts
    total += routed - routed // args.expert_parallel
    return total, total - routed + routed * args.top_k // args.experts


def plot_losses(train_losses, val_points, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = np.arange(1, len(train_losses) + 1)
    ax.plot(steps, train_losses, color="tab:blue", alpha=0.25, lw=0.8)
    k = max(1, len(train_losses) // 50)
    smooth = np.convolve(train_losses, np.ones(k) / k, mode="valid")
    ax.plot(steps[k - 1:], smooth, color="tab:blue", label="train")
    if val_points:
        vs, vl = zip(*val_points)
        ax.plot(vs, vl, "o-", color="tab:orange", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / char)")
    ax.set_title("MoE character language model")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_expert_load(loads, path):
    """loads [steps, layers, experts]: share of the routed tokens per expert over time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, layers, experts = loads.shape
    k = max(1, steps // 50)
    fig, axes = plt.subplots(layers, 1, figsize=(7, 2.6 * layers), squeeze=False, sharex=True)
    for layer in range(layers):
        share = loads[:, layer] / np.maximum(loads[:, layer].sum(1, keepdims=True), 1)
        share = np.stack([np.convolve(share[:, e], np.ones(k) / k, mode="valid")
                          for e in range(experts)])
        ax = axes[layer, 0]
        ax.stackplot(np.arange(k, steps + 1), share, labels=[f"expert {e}" for e in range(experts)])
        # perfect balance: every band between two neighbouring dashed lines, 1/E apart
        for e in range(1, experts):
            ax.axhline(e / experts, color="black", lw=0.6, ls="--", alpha=0.6)
        ax.set_ylim(0, 1)
        ax.set_ylabel(f"layer {layer}\nshare of tokens")
    axes[-1, 0].set_xlabel("step")
    # (two short lines: one long line ran past both edges of the figure)
    axes[0, 0].set_title(f"share of tokens per expert\nbalanced: each band between two dashed "
                         f"lines (1/{experts})", fontsize=10)
    if experts <= 16:
        axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
