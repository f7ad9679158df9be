"""Quantised experts (`ms_moe_ops.quantize`, int8 = W8A8 and w8a16 = weight-only) against float32:
the validation loss of a model trained by examples/train_moe.py, the bytes of its expert
weights, and the logits drift of every family's tiny converted model (tests/hf_models.py).

    python examples/train_moe.py --steps 300 --out runs/q300     # the trained model (~1.5 min)
    python benchmarks/quantize_report.py --run runs/q300         # + the train_moe flags it used
    python benchmarks/quantize_report.py --run RUN --model causal-lm   # a --model causal-lm run
    python benchmarks/quantize_report.py --families-only         # no trained model needed

The validation loss is the mean over --eval-batches fixed batches of the validation text (the
same for every variant); int8 calibrates on --calibration training batches.
"""
import argparse
import os
import sys
import tempfile

import numpy as np
import mindspore as ms
from mindspore import Tensor

import ms_moe_ops

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def expert_bytes(net):
    """(bytes of the routed experts' int8/float weights, bytes of all their parameters)."""
    weights = total = 0
    for layer in ms_moe_ops.moe_layers(net):
        for name, p in layer.experts.parameters_and_names():
            n = p.asnumpy().nbytes
            total += n
            weights += n if name.split(".")[-1] in ("weight1", "weight2") else 0
    return weights, total


def trained_model_report(args):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_moe
    from moe_lm import CharData, MoELanguageModel

    flags = train_moe.parse_args(args.train_flags)
    data = CharData()

    def load():
        if flags.model == "causal-lm":  # the directory load_pretrained reads
            from ms_moe_ops.convert import load_pretrained

            lm = load_pretrained(args.run)
            net = ms.nn.SequentialCell(lm, ms.nn.Flatten(0, 1))
            net.set_train(False)
            return net
        net = MoELanguageModel(data.vocab_size, flags.seq_len, flags.heads, flags.layers,
                               train_moe.moe_config(flags))
        ms.load_param_into_net(net, ms.load_checkpoint(os.path.join(args.run, "moe_lm.ckpt")))
        net.set_train(False)
        return net

    rng = np.random.default_rng(1234)
    val = [data.batch("val", flags.batch_size, flags.seq_len, rng)
           for _ in range(args.eval_batches)]
    calibration = [data.batch("train", flags.batch_size, flags.seq_len, rng)[0]
                   for _ in range(args.calibration)]
    loss_fn = ms.nn.CrossEntropyLoss()

    def val_loss(net):
        return float(np.mean([float(loss_fn(net(Tensor(x, ms.int32)),
                                            Tensor(y.reshape(-1), ms.int32))) for x, y in val]))

    rows = []
    base = None
    for mode in (None, "w8a16", "int8"):
        net = load()
        if mode:
            ms_moe_ops.quantize(net, mode, calibration=calibration)
        loss = val_loss(net)
        base = loss if base is None else base
        weights, total = expert_bytes(net)
        rows.append((mode or "float32", loss, 100 * (loss - base) / base, weights, total))
    print(f"== examples/train_moe.py model ({args.run}; {flags.layers} layers, d_model "
          f"{flags.d_model}, {flags.experts} experts of {flags.ffn}, top-{flags.top_k}; val loss "
          f"over {args.eval_batches} x {flags.batch_size} x {flags.seq_len} characters; int8 "
          f"calibrated on {args.calibration} training batches) ==")
    print(f"{'experts':10s} {'val loss':>9s} {'vs float':>9s} {'expert weights':>15s} "
          f"{'with scales':>12s}")
    for mode, loss, rel, weights, total in rows:
        print(f"{mode:10s} {loss:9.4f} {rel:+8.2f}% {weights / 1024:12.1f} KiB "
              f"{total / 1024:9.1f} KiB ({rows[0][4] / total:.2f}x smaller)")


def family_report():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from hf_models import FAMILIES, hf_model, save
    from ms_moe_ops.convert import convert_checkpoint, load_pretrained

    print("== logits drift on tiny converted models (tests/hf_models.py: hidden 32, 8 experts of "
          "16, top-2, random weights; 2 x 16 random ids; int8 calibrated on 4 other batches) ==")
    print(f"{'family':12s} {'mode':6s} {'max |dlogit|':>12s} {'max rel':>8s} {'argmax kept':>11s}")
    for family in FAMILIES:
        rng = np.random.default_rng(0)
        with tempfile.TemporaryDirectory() as tmp:
            save(hf_model(family, rng), os.path.join(tmp, "hf"))
            convert_checkpoint(os.path.join(tmp, "hf"), os.path.join(tmp, "ms"))
            ids = Tensor(rng.integers(0, 64, (2, 16)).astype(np.int32))
            calibration = [rng.integers(0, 64, (2, 16)) for _ in range(4)]
            expected = load_pretrained(os.path.join(tmp, "ms"))(ids).asnumpy()
            for mode in ("w8a16", "int8"):
                net = ms_moe_ops.quantize(load_pretrained(os.path.join(tmp, "ms")), mode,
                                          calibration=calibration)
                logits = net(ids).asnumpy()
                drift = np.abs(logits - expected).max()
                kept = (logits.argmax(-1) == expected.argmax(-1)).mean()
                print(f"{family:12s} {mode:6s} {drift:12.4f} {drift / np.abs(expected).max():8.4f} "
                      f"{100 * kept:10.1f}%")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="runs/moe_lm", help="a train_moe.py --out directory")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--calibration", type=int, default=8, help="int8 calibration batches")
    p.add_argument("--families-only", action="store_true")
    p.add_argument("--no-families", action="store_true")
    args, args.train_flags = p.parse_known_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE)
    if not args.families_only:
        trained_model_report(args)
    if not args.no_families:
        family_report()


if __name__ == "__main__":
    main()
