"""python -m ms_moe_ops.generate MODEL_DIR --prompt "...": text from a MoE language model with
a KV cache, streamed as it comes, then the decoding speed.

MODEL_DIR is a checkpoint written by `python -m ms_moe_ops.convert` (or by examples/train_moe.py)
or a transformers checkpoint directory (converted into a temporary directory first). The text
is tokenized with the directory's `tokenizer.json` (the `tokenizers` library; nothing is
downloaded), or `chars.json` (a JSON list of characters, index = token id) for a
character-level model. Errors print one line naming the file and the problem, exit code 2."""
# pylint: disable=import-outside-toplevel
# (MindSpore and the models load only once the arguments and files are checked: errors are quick)
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np


class CommandError(Exception):
    """A problem with the command's inputs: printed as one line, exit code 2."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m ms_moe_ops.generate",
        description="Generate text from a MoE language model (DeepSeek-V3/V2, Qwen3-MoE, "
                    "Qwen2-MoE, Mixtral) with a KV cache, streaming the tokens as they come.")
    p.add_argument("model_dir", help="a checkpoint written by python -m ms_moe_ops.convert (or "
                                     "examples/train_moe.py), or a transformers checkpoint "
                                     "directory (converted on the fly)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--tokenizer", help="tokenizer.json or chars.json to use (default: the one in "
                                       "MODEL_DIR)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many (default 64)")
    p.add_argument("--mode", choices=("graph", "pynative"), default="graph",
                   help="MindSpore's execution mode (default graph: one compiled decode step)")
    p.add_argument("--greedy", action="store_true", help="the most likely token each step "
                                                         "(the sampling flags are ignored)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k best (0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the fewest best tokens whose probability reaches p")
    p.add_argument("--seed", type=int, default=None, help="the sampling seed")
    p.add_argument("--quantize", choices=("int8", "w8a16"),
                   help="int8 experts: W8A8 (int8; activation scales calibrated on the prompt) "
                        "or weight-only (w8a16)")
    return p.parse_args(argv)


class Tokenizer:
    """tokenizer.json through the `tokenizers` library, or chars.json (one character a token)."""

    def __init__(self, path):
        self.path = path
        if os.path.basename(path) == "chars.json" or path.endswith("chars.json"):
            with open(path, encoding="utf-8") as f:
                self.chars = json.load(f)
            if not isinstance(self.chars, list) or not all(
                    isinstance(c, str) and len(c) == 1 for c in self.chars):
                raise CommandError(f"{path}: expected a JSON list of single characters")
            self.index = {c: i for i, c in enumerate(self.chars)}
            self.tokenizer = None
        else:
            try:
                from tokenizers import Tokenizer as Reader
            except ImportError as err:
                raise CommandError(f"{path}: reading it needs the tokenizers package "
                                   f"(pip install tokenizers)") from err
            try:
                self.tokenizer = Reader.from_file(path)
            except Exception as err:  # the library raises its own exception types
                raise CommandError(f"{path}: not a tokenizer file the tokenizers library "
                                   f"reads ({err})") from err

    def encode(self, text):
        if self.tokenizer is not None:
            return self.tokenizer.encode(text).ids
        unknown = sorted({c for c in text if c not in self.index})
        if unknown:
            raise CommandError(f"{self.path}: the prompt has characters the model does not "
                               f"know: {''.join(unknown)!r}")
        return [self.index[c] for c in text]

    def decode(self, ids):
        if self.tokenizer is not None:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return "".join(self.chars[i] if i < len(self.chars) else "" for i in ids)


def find_tokenizer(model_dir, given=None):
    if given is not None:
        if not os.path.isfile(given):
            raise CommandError(f"{given}: no such tokenizer file")
        return Tokenizer(given)
    for name in ("tokenizer.json", "chars.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            return Tokenizer(path)
    raise CommandError(f"{model_dir}: no tokenizer (neither tokenizer.json nor chars.json; "
                       f"copy the original checkpoint's tokenizer.json there, or pass "
                       f"--tokenizer)")


def load_model(model_dir, workdir):
    """The MoECausalLM of model_dir, converted into workdir first when it is a transformers
    checkpoint; and its config.json as a dict."""
    from .convert import RECORD, convert_checkpoint, load_pretrained
    from .models import CausalLMConfig

    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise CommandError(f"{config_path}: no such file (MODEL_DIR must hold a checkpoint's "
                           f"config.json)")
    with open(config_path, encoding="utf-8") as f:
        raw = json.load(f)
    try:
        CausalLMConfig.from_transformers(raw)
        if not os.path.isfile(os.path.join(model_dir, RECORD)):
            print(f"converting {model_dir} (a transformers checkpoint) ...", file=sys.stderr)
            converted = os.path.join(workdir, "ms")
            convert_checkpoint(model_dir, converted)
            model_dir = converted
        return load_pretrained(model_dir), raw
    except (ValueError, TypeError, OSError) as err:
        message = str(err)
        if not message.startswith(model_dir):
            message = f"{config_path}: {message}"
        raise CommandError(message) from err


def run(args):
    if not os.path.isdir(args.model_dir):
        what = "is not a directory" if os.path.exists(args.model_dir) else "no such directory"
        raise CommandError(f"{args.model_dir}: {what}")
    if args.max_new_tokens < 1:
        raise CommandError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    tokenizer = find_tokenizer(args.model_dir, args.tokenizer)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise CommandError("the prompt is empty once tokenized")

    import mindspore as ms
    import ms_moe_ops
    from .models import DecodeStep, generate

    ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE)
    with tempfile.TemporaryDirectory(prefix="ms_moe_ops-generate-") as workdir:
        net, raw = load_model(args.model_dir, workdir)
    context = net.config.rope.max_position_embeddings
    if len(ids) >= context:
        raise CommandError(f"{os.path.join(args.model_dir, 'config.json')}: the prompt is "
                           f"{len(ids)} tokens, the model's context (max_position_embeddings) "
                           f"is {context}")
    new = min(args.max_new_tokens, context - len(ids))
    if args.quantize:
        # int8's static activation scales are calibrated on the prompt, the only text of the run
        calibration = [ms.Tensor(np.array([ids], np.int32))] if args.quantize == "int8" else None
        ms_moe_ops.quantize(net, args.quantize, calibration=calibration)
        print(f"routed experts quantised: {args.quantize}", file=sys.stderr)

    generated = []
    shown = [""]

    times = []

    prompt_text = tokenizer.decode(ids)

    def stream(tokens):
        times.append(time.perf_counter())
        generated.append(int(tokens[0]))
        # decoded with the prompt, so that the tokenizer places the spaces between them
        text = tokenizer.decode(ids + generated)[len(prompt_text):]
        if text.startswith(shown[0]):  # a partial multi-byte character may change later
            sys.stdout.write(text[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = text

    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    step = DecodeStep(net)
    start = time.perf_counter()
    generate(net, np.array([ids]), new, raw.get("eos_token_id"), do_sample=not args.greedy,
             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
             streamer=stream, step=step)
    sys.stdout.write("\n")
    # the first token comes from the prompt's pass (and the compilations): timed apart
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
    print(f"{len(generated)} tokens: first after {times[0] - start:.2f} s, then "
          f"{rate:.1f} tokens/s (prompt {len(ids)} tokens, {args.mode} mode)", file=sys.stderr)
    return generated


def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except CommandError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _sleeping_openmp():
    """Runs the command again with OpenMP's idle threads sleeping rather than spinning, unless
    OMP_WAIT_POLICY is set: between the many small kernels of a decode step MindSpore's own
    threads need the cores, and spinning ones made a step take up to 4x longer on 2 cores
    (training's few large kernels prefer spinning, so this is the command's choice only).
    libgomp reads the policy once, when it loads, and `import mindspore` (before this module:
    the package imports it) has loaded it."""
    if os.environ.get("OMP_WAIT_POLICY") or os.name != "posix":
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    sys.stdout.flush()
    os.execv(sys.executable, sys.orig_argv)


if __name__ == "__main__":
    _sleeping_openmp()
    sys.exit(main())
