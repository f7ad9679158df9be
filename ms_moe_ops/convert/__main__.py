"""python -m ms_moe_ops.convert SRC DST: a transformers checkpoint directory -> a MindSpore one
(and back with --to-transformers); see ms_moe_ops.convert."""
import argparse
import sys
import time

from . import DTYPES, convert_checkpoint, export_checkpoint
from ._layout import LAYOUTS


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m ms_moe_ops.convert",
        description="Convert a transformers MoE checkpoint directory (DeepSeek-V3/V2, "
                    "Qwen3-MoE, Qwen2-MoE, Mixtral; per-expert or fused experts) into a MindSpore "
                    "checkpoint for ms_moe_ops.models, one block at a time; or, with "
                    "--to-transformers, a MindSpore checkpoint back into transformers' layout.")
    p.add_argument("src", help="the checkpoint directory to read (config.json and safetensors "
                               "files; with --to-transformers: a directory this command wrote, "
                               "or a .safetensors file saved by MindSpore)")
    p.add_argument("dst", help="the directory to write (must not exist, unless --overwrite)")
    p.add_argument("--to-transformers", action="store_true",
                   help="export MindSpore parameters to the transformers layout")
    p.add_argument("--reference", help="with --to-transformers: the directory this command "
                                       "wrote from the original checkpoint, whose names, layout, "
                                       "dtypes and files are reproduced")
    p.add_argument("--config", help="with --to-transformers and no reference: the transformers "
                                    "config.json")
    p.add_argument("--layout", choices=LAYOUTS, help="with --to-transformers: the experts' layout "
                                                     "(default: the reference's, else per-expert)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="with --to-transformers: the dtype "
                                                           "written (default: the reference's, "
                                                           "else float32)")
    p.add_argument("--overwrite", action="store_true", help="replace dst if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        if args.to_transformers:
            reference = args.reference
            report = export_checkpoint(args.src, args.dst, reference=reference, config=args.config,
                                       layout=args.layout, dtype=args.dtype,
                                       overwrite=args.overwrite, progress=not args.quiet)
        else:
            for name in ("reference", "config", "layout", "dtype"):
                if getattr(args, name) is not None:
                    raise ValueError(f"--{name} is an option of --to-transformers")
            report = convert_checkpoint(args.src, args.dst, overwrite=args.overwrite,
                                        progress=not args.quiet)
    except (ValueError, TypeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    print(f"wrote {args.dst}: {report['tensors']} tensors in {len(report['files'])} file(s), "
          f"{report['written_bytes'] / 2**20:.1f} MiB, {seconds:.1f} s")
    if report.get("skipped"):
        print(f"skipped {len(report['skipped'])} tensor(s) the model does not use, e.g. "
              f"{report['skipped'][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
