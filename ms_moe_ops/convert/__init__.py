"""Checkpoints between transformers and `ms_moe_ops.models`, one block at a time.

- `convert_checkpoint(src, dst)`: a transformers checkpoint directory (config.json and
  `model.safetensors`, or `model.safetensors.index.json` and its shards) of a DeepSeek-V3,
  DeepSeek-V2, Qwen3-MoE, Qwen2-MoE or Mixtral model, in the Hub's per-expert layout or
  transformers 5's fused one -> a MindSpore checkpoint directory: safetensors files sharded like
  the source (`ms.load_checkpoint(file, format="safetensors")` reads each), its index, the
  source's config.json and `conversion.json` (what the source held, for the way back). Every
  MoE block becomes MoELayer parameters (`convert_moe_checkpoint`), every other tensor keeps its
  name (the models' parameters are named as transformers names them).
- `export_checkpoint(params, dst, reference=...)`: the way back, to the family's transformers
  layout, which `AutoModelForCausalLM.from_pretrained(dst)` loads; with the converted directory
  as reference it reproduces the source's names, layout, dtypes and shards, so a round trip
  changes no bit.
- `load_checkpoint(path, net)`: a converted directory (or one safetensors file) into a model,
  one shard at a time.

Memory: the whole plan (every name, shape and dtype, so every error in the input) is made from
the files' headers before anything is written; then each unit (one MoE block, or one other
tensor) is read, converted and written at its place in its output file, so the resident memory
grows with the largest block (about twice its float32 size), not with the model. Files
are read as safetensors only (never pickle). The output goes to a temporary directory beside dst,
renamed to dst once complete; on any error it is removed.

The command: `python -m ms_moe_ops.convert SRC DST` (and `--to-transformers`); see --help.
"""
import contextlib
import json
import os
import re
import shutil
import tempfile

import numpy as np
import mindspore as ms

from .. import _compat
from ..models import MoECausalLM
from ..models.config import CausalLMConfig
from ..nn.families import convert_moe_checkpoint
from ._layout import LAYOUTS, block_prefixes, block_tensors, export_block, export_prefix
from ._safetensors import DTYPE_BYTES, SafetensorsFile, SafetensorsWriter

__all__ = ["convert_checkpoint", "export_checkpoint", "load_pretrained", "load_checkpoint", "TensorFiles"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
RECORD = "conversion.json"
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class TensorFiles:
    """The tensors of a checkpoint: a directory holding `model.safetensors.index.json` and its
    shards or one `model.safetensors` (or the path of one safetensors file). Headers only are
    read here; `read(name)` reads one tensor. A shard the index lists but the directory lacks,
    a tensor the index places in a shard that does not hold it, or one name in two files is a
    clear error."""

    def __init__(self, path):
        path = os.fspath(path)
        self.path = path
        if os.path.isfile(path):
            self.index, self.files = None, [os.path.basename(path)]
            self.dir = os.path.dirname(path)
        elif os.path.isdir(path):
            self.dir = path
            index = os.path.join(path, INDEX)
            if os.path.isfile(index):
                self.index = index
                try:
                    with open(index, encoding="utf-8") as f:
                        weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ValueError(f"{index}: not a safetensors index ({err!r})") from None
                self.files = sorted(set(weight_map.values()))
            elif os.path.isfile(os.path.join(path, SINGLE)):
                self.index, self.files, weight_map = None, [SINGLE], None
            else:
                raise FileNotFoundError(
                    f"{path}: neither {INDEX} nor {SINGLE} (only safetensors checkpoints are "
                    f"read; pytorch_model.bin files are pickles, which are never loaded)")
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
        self._open = {}
        self.where = {}  # tensor name -> file name
        for name in self.files:
            file = os.path.join(self.dir, name)
            if os.sep in name or not name.endswith(".safetensors"):
                raise ValueError(f"{self.index}: '{name}' is not a safetensors file beside it")
            if not os.path.isfile(file):
                listed = next(k for k, v in weight_map.items() if v == name)
                raise FileNotFoundError(f"{file}: missing shard ({self.index} places '{listed}' "
                                        f"in it)")
            self._open[name] = SafetensorsFile(file)
            for tensor in self._open[name].names:
                if tensor in self.where:
                    raise ValueError(f"{file}: tensor '{tensor}' is also in {self.where[tensor]}")
                self.where[tensor] = name
        if self.index is not None:
            for tensor, name in weight_map.items():
                if self.where.get(tensor) != name:
                    raise ValueError(f"{os.path.join(self.dir, name)}: tensor '{tensor}' is not "
                                     f"in this file, but {self.index} places it there")

    @property
    def names(self):
        return list(self.where)

    def file(self, name):
        """The path of the file holding tensor `name`."""
        return os.path.join(self.dir, self.where[name])

    def shape(self, name):
        return self._open[self.where[name]].shape(name)

    def dtype(self, name):
        return self._open[self.where[name]].dtype(name)

    def nbytes(self, name):
        return self._open[self.where[name]].nbytes(name)

    def read(self, name):
        """float32 numpy (bfloat16 and float16 widened exactly)."""
        return self._open[self.where[name]].read(name)

    def read_into(self, name, out):
        """Reads tensor `name` into a float32 C-contiguous array (or slice) of its shape."""
        self._open[self.where[name]].read_into(name, out)


class _Unit:
    """One step of a conversion: run() reads `sources` (nbytes in all) and returns `outputs`
    {name: array of the planned shape}; `places` {output: source tensor} says which source
    file each output goes to when the output is sharded like the source."""

    def __init__(self, sources, outputs, run, nbytes, places=None):
        self.sources, self.outputs, self.run, self.nbytes = sources, outputs, run, nbytes
        self.places = places


# -- transformers -> MindSpore ---------------------------------------------------------------------

def convert_checkpoint(src, dst, overwrite=False, progress=False):
    """A transformers checkpoint directory -> a MindSpore checkpoint directory for
    `ms_moe_ops.models.MoECausalLM` (see the module's docstring). Returns a dict: files,
    tensors (written), read_bytes, written_bytes, skipped (source tensors no model parameter
    needs: DeepSeek-V3's multi-token-prediction layers past num_hidden_layers, a tied lm_head).

    Errors name the file and the tensor: a missing shard, a tensor of the wrong shape or dtype,
    one no rule converts, one the model needs but the checkpoint lacks, an unknown model_type.
    dst must not exist, unless overwrite (a directory, replaced once the new one is complete)."""
    if not os.path.isdir(src):
        what = "is a file, not a directory" if os.path.exists(src) else "does not exist"
        raise ValueError(f"{src} {what}: convert_checkpoint reads a checkpoint directory "
                         f"(config.json beside the safetensors files)")
    source = TensorFiles(src)
    config = CausalLMConfig.from_transformers(src)
    units, layouts, skipped = _plan_conversion(source, config)
    files = {}
    for unit in units:
        for name, shape in unit.outputs.items():
            files.setdefault(source.where[unit.places[name]], []).append((name, "F32", shape))
    record = {"format": "ms_moe_ops.convert", "version": 1, "family": config.family,
              "blocks": layouts, "skipped": skipped,
              "source": {"weight_map": dict(source.where),
                         "dtypes": {n: source.dtype(n) for n in source.names}}}
    with _staging(dst, overwrite, src) as tmp:
        _copy_config(os.path.join(src, "config.json"), tmp)
        written = _write(tmp, files, units, {"format": "ms"}, progress)
        with open(os.path.join(tmp, RECORD), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
    return {"files": sorted(files), "tensors": sum(len(u.outputs) for u in units),
            "read_bytes": sum(u.nbytes for u in units),
            "written_bytes": written, "skipped": skipped}


def _plan_conversion(source, config):
    """(units, {block: its source prefix and layout}, skipped names), after checking every
    name, shape and dtype of the source against the model's parameters."""
    shapes = config.parameter_shapes()
    family = config.family
    units, layouts, claimed = [], {}, set()
    by_layer = {}
    for name in source.names:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer:
            by_layer.setdefault(int(layer.group(1)), []).append(name)
    for layer in config.moe_layers:
        ours = f"model.layers.{layer}.mlp."
        prefixes = block_prefixes(family, layer)
        found = [p for p in prefixes if any(n.startswith(p) for n in by_layer.get(layer, ()))]
        if not found:
            raise ValueError(f"{source.path}: no tensors of layer {layer}'s MoE block "
                             f"({' or '.join(prefixes)}*)")
        if len(found) > 1:
            raise ValueError(f"{source.path}: layer {layer}'s MoE block is under both "
                             f"{found[0]} and {found[1]}")
        prefix = found[0]
        present = {n[len(prefix):] for n in by_layer[layer] if n.startswith(prefix)}
        layout = "fused" if "experts.gate_up_proj" in present else "per-expert"
        wanted = block_tensors(config.moe, family, layout)
        expected = {rel: shape for _, tensors in wanted for rel, shape in tensors}
        for rel in sorted(present - set(expected)):
            raise ValueError(f"{source.file(prefix + rel)}: tensor '{prefix + rel}' is not part of "
                             f"a {family} MoE block ({layout} layout): no rule converts it")
        for rel in sorted(set(expected) - present):
            raise ValueError(f"{source.path}: tensor '{prefix + rel}' is missing (a {family} MoE "
                             f"block in the {layout} layout has it)")
        for rel, shape in expected.items():
            _check_tensor(source, prefix + rel, shape)
        outputs = {ours + k: shapes[ours + k] for k, _ in wanted}
        names = [prefix + rel for rel in expected]
        # each output in the file of its first source (a missing bias in the router's)
        places = {ours + k: prefix + (tensors[0][0] if tensors else "gate.weight")
                  for k, tensors in wanted}
        units.append(_Unit(names, outputs, _block_converter(source, wanted, prefix, ours, family,
                                                            layout, outputs),
                           sum(source.nbytes(n) for n in names), places))
        claimed.update(names)
        layouts[ours] = {"prefix": prefix, "layout": layout}
    skipped = []
    for name in source.names:
        if name in claimed:
            continue
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if (layer and int(layer.group(1)) >= config.num_layers) or (
                name == "lm_head.weight" and config.tie_word_embeddings):
            skipped.append(name)
            continue
        if name not in shapes:
            raise ValueError(f"{source.file(name)}: tensor '{name}' is not a parameter of the "
                             f"{family} model of {source.path}/config.json and no rule converts "
                             f"it")
        _check_tensor(source, name, shapes[name])
        units.append(_Unit([name], {name: shapes[name]},
                           lambda name=name: {name: source.read(name)}, source.nbytes(name),
                           {name: name}))
        claimed.add(name)
    produced = {n for u in units for n in u.outputs}
    for name in shapes:
        if name not in produced:
            raise ValueError(f"{source.path}: tensor '{name}' is missing (the {family} model "
                             f"of its config.json has this parameter)")
    # read in file order
    order = {name: i for i, name in enumerate(source.files)}
    units.sort(key=lambda u: order[source.where[u.sources[0]]])
    return units, layouts, skipped


def _check_tensor(source, name, shape):
    if tuple(source.shape(name)) != tuple(shape):
        raise ValueError(f"{source.file(name)}: tensor '{name}' is {list(source.shape(name))}, "
                         f"the configuration makes it {list(shape)}")
    if source.dtype(name) not in DTYPE_BYTES:
        raise ValueError(f"{source.file(name)}: tensor '{name}' has dtype {source.dtype(name)}; "
                         f"float tensors (F32, F16, BF16, F64) are converted")


def _block_converter(source, wanted, prefix, ours, family, layout, outputs):
    """run() of one MoE block: its tensors read (per-expert ones straight into the fused
    [E, 2I, H] and [E, H, I] arrays transformers 5 holds, which costs one float32 copy of the
    experts instead of three), then convert_moe_checkpoint."""
    def run():
        state = {}
        for parameter, tensors in wanted:
            if layout == "per-expert" and parameter.startswith("experts."):
                continue
            for rel, _ in tensors:
                state[prefix + rel] = source.read(prefix + rel)
        if layout == "per-expert":
            state.update(_fused_experts(source, prefix, dict(wanted)))
        out = convert_moe_checkpoint(state, prefix, ours, family)
        for name, shape in outputs.items():  # what the plan promised
            if tuple(out[name].shape) != tuple(shape):
                raise ValueError(f"convert_moe_checkpoint made '{name}' {list(out[name].shape)}, "
                                 f"the model has {list(shape)}")
        return out
    return run


def _fused_experts(source, prefix, wanted):
    """{experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]} from the per-expert
    tensors (gate then up of each expert for weight1, down for weight2; see block_tensors)."""
    pairs, downs = wanted["experts.weight1"], wanted["experts.weight2"]
    i, h = pairs[0][1]
    gate_up = np.empty((len(downs), 2 * i, h), np.float32)
    down = np.empty((len(downs), h, i), np.float32)
    for e, (rel, _) in enumerate(downs):
        source.read_into(prefix + pairs[2 * e][0], gate_up[e, :i])
        source.read_into(prefix + pairs[2 * e + 1][0], gate_up[e, i:])
        source.read_into(prefix + rel, down[e])
    return {prefix + "experts.gate_up_proj": gate_up, prefix + "experts.down_proj": down}


# -- MindSpore -> transformers ---------------------------------------------------------------------

def export_checkpoint(params, dst, reference=None, config=None, layout=None, dtype=None,
                      overwrite=False, progress=False):
    """A model's parameters -> a transformers checkpoint directory that
    `AutoModelForCausalLM.from_pretrained(dst)` loads (config.json and safetensors files).

    Args:
        params: a MoECausalLM (or any Cell with its parameter names), a dict {name: Tensor or
            numpy}, or the path of a checkpoint (a directory written by convert_checkpoint, or
            a safetensors file from `ms.save_checkpoint(net, path, format="safetensors")`).
        dst: the directory to write (must not exist, unless overwrite).
        reference: the directory convert_checkpoint wrote: the source's config.json, and its
            names, layout, dtypes and files are reproduced (a round trip changes no bit).
        config: the transformers configuration (config.json path, dict or config object) when
            there is no reference.
        layout: "per-expert" (the Hub's; default) or "fused" (transformers 5's names).
        dtype: "float32" (default), "bfloat16" (rounded to nearest-even) or "float16".

    Returns {files, tensors, written_bytes}."""
    record = None
    if reference is not None:
        try:
            with open(os.path.join(reference, RECORD), encoding="utf-8") as f:
                record = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{reference}: no {RECORD} (the reference is a directory "
                                    f"written by convert_checkpoint)") from None
        config = config or os.path.join(reference, "config.json")
    elif config is None and isinstance(params, (str, os.PathLike)) and os.path.isfile(
            os.path.join(params, "config.json")):
        config = os.path.join(params, "config.json")
    if config is None:
        raise ValueError("export_checkpoint: give reference (a convert_checkpoint directory) or "
                         "config (the transformers config.json)")
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"export_checkpoint: layout must be one of {LAYOUTS}, got {layout!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"export_checkpoint: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    cfg = CausalLMConfig.from_transformers(config)
    source = _parameters(params)
    shapes = cfg.parameter_shapes()
    for name, shape in shapes.items():
        if name not in source:
            raise ValueError(f"export_checkpoint: the parameters have no '{name}' (a {cfg.family} "
                             f"model of this configuration has it)")
        if tuple(source[name][0]) != tuple(shape):
            raise ValueError(f"export_checkpoint: '{name}' is {list(source[name][0])}, the "
                             f"configuration makes it {list(shape)}")
    recorded = (record or {}).get("source", {"weight_map": {}, "dtypes": {}})
    units = []
    for layer in cfg.moe_layers:
        ours = f"model.layers.{layer}.mlp."
        block = (record or {}).get("blocks", {}).get(ours)  # its layout in the source
        block_layout = layout or (block["layout"] if block else "per-expert")
        prefix = (block["prefix"] if block and block["layout"] == block_layout
                  else export_prefix(cfg.family, layer, block_layout))
        wanted = block_tensors(cfg.moe, cfg.family, block_layout)
        outputs = {prefix + rel: shape for _, tensors in wanted for rel, shape in tensors}
        inputs = [ours + k for k, _ in wanted]
        # names the source did not have (another layout) go to the file of the block's router
        router = (block or {}).get("prefix", prefix) + "gate.weight"
        places = {name: name if name in recorded["weight_map"] else router for name in outputs}
        units.append(_Unit(inputs, outputs, _block_exporter(
            source, ours, prefix, cfg.family, block_layout, inputs), _nbytes(shapes, inputs),
            places))
    moe = {n for u in units for n in u.sources}
    for name in shapes:
        if name not in moe:
            units.append(_Unit([name], {name: shapes[name]},
                               lambda name=name: {name: source[name][1]()},
                               _nbytes(shapes, [name]), {name: name}))
    files = {}
    for unit in units:
        for name, shape in unit.outputs.items():
            origin = unit.places[name]
            stored = DTYPES[dtype] if dtype else recorded["dtypes"].get(origin, "F32")
            file = recorded["weight_map"].get(origin, SINGLE)
            files.setdefault(file, []).append((name, stored, shape))
    with _staging(dst, overwrite) as tmp:
        if isinstance(config, (str, os.PathLike)):
            _copy_config(config, tmp)
        else:
            with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
                json.dump(config if isinstance(config, dict) else config.to_dict(), f, indent=2)
        written = _write(tmp, files, units, {"format": "pt"}, progress)
    return {"files": sorted(files), "tensors": sum(len(u.outputs) for u in units),
            "written_bytes": written}


def _nbytes(shapes, names):
    """float32 bytes of the named parameters."""
    return sum(4 * int(np.prod(shapes[n])) for n in names)


def _block_exporter(source, ours, prefix, family, layout, inputs):
    def run():
        params = {name[len(ours):]: source[name][1]() for name in inputs}
        out = export_block(params, family, layout, where=ours)
        return {prefix + rel: value for rel, value in out.items()}
    return run


def _parameters(params):
    """{name: (shape, read() -> float32 numpy)} of a Cell, a dict or a checkpoint path. Names
    may carry the prefix of the Cells that wrapped the model in training (a checkpoint that
    `ms.save_checkpoint` wrote after TrainOneStepCell(CausalLMLoss(net)) says
    `net.model.embed_tokens.weight`): it is taken off."""
    if isinstance(params, (str, os.PathLike)):
        files = TensorFiles(params)
        found = {n: (files.shape(n), lambda n=n: files.read(n)) for n in files.names}
    else:
        if hasattr(params, "parameters_and_names"):
            params = dict(params.parameters_and_names())
        if not isinstance(params, dict):
            raise TypeError(f"export_checkpoint: params must be a Cell, a dict or a path, got "
                            f"{type(params).__name__}")

        def reader(value):
            def read():
                array = value.asnumpy() if hasattr(value, "asnumpy") else np.asarray(value)
                return array.astype(np.float32, copy=False)
            return read
        found = {name: (tuple(value.shape), reader(value)) for name, value in params.items()}
    anchor = "model.embed_tokens.weight"
    if anchor not in found:
        prefixes = [n[:-len(anchor)] for n in found if n.endswith("." + anchor)]
        if len(prefixes) == 1:
            found = {n[len(prefixes[0]):]: v for n, v in found.items() if n.startswith(prefixes[0])}
    return found


# -- MindSpore side -----------------------------------------------------------------------------

def load_pretrained(path, **moe_overrides):
    """The MoECausalLM of a directory written by convert_checkpoint (its config.json and
    weights); moe_overrides set MoEConfig options (bias_update_rate, the training losses)."""
    net = MoECausalLM(CausalLMConfig.from_transformers(path, **moe_overrides))
    return load_checkpoint(path, net)


def load_checkpoint(path, net=None):
    """A checkpoint directory written by convert_checkpoint (or one safetensors file) -> the
    net's parameters, one file at a time (`ms.load_checkpoint(file, format="safetensors")`
    and `ms.load_param_into_net`); returns the net. Every parameter except the routing
    statistics and state (router.tokens_per_expert, router.aux_losses, the loss scale of its
    training losses) must be in the checkpoint, and
    every tensor of the checkpoint must be a parameter of the same shape. Without a net: the
    dict of all parameters."""
    files = TensorFiles(path)
    if net is None:
        params = {}
        for name in files.files:
            params.update(ms.load_checkpoint(os.path.join(files.dir, name), format="safetensors"))
        return params
    wanted = dict(net.parameters_and_names())
    for name in files.names:
        if name not in wanted:
            hint = (" (a transformers checkpoint? python -m ms_moe_ops.convert converts it)"
                    if not os.path.isfile(os.path.join(files.dir, RECORD)) else "")
            raise ValueError(f"{files.file(name)}: tensor '{name}' is not a parameter of the "
                             f"model{hint}")
        if tuple(files.shape(name)) != tuple(wanted[name].shape):
            raise ValueError(f"{files.file(name)}: tensor '{name}' is {list(files.shape(name))}, "
                             f"the model's parameter is {list(wanted[name].shape)}")
    statistics = ("router.tokens_per_expert", "router.aux_losses", "loss_scaler.loss_scale")
    missing = [n for n in wanted if n not in files.where and not n.endswith(statistics)]
    if missing:
        raise ValueError(f"{files.path}: parameters of the model not in the checkpoint: "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for name in files.files:
        params = ms.load_checkpoint(os.path.join(files.dir, name), format="safetensors")
        # what a file lacks is in another one or is run-time state (both checked above):
        # MindSpore's warning that it "is not loaded" would say nothing true
        with _compat.unlogged("are not loaded"):
            ms.load_param_into_net(net, params, strict_load=True)
        del params
    return net


# -- writing --------------------------------------------------------------------------------------

def _write(tmp, files, units, metadata, progress):
    """Runs the units, each output written at its place in its file; the index when there are
    several files. Returns the bytes written."""
    writers = {name: SafetensorsWriter(os.path.join(tmp, name), entries, metadata)
               for name, entries in files.items()}
    where = {entry[0]: name for name, entries in files.items() for entry in entries}
    bar = _progress_bar(progress, sum(u.nbytes for u in units))
    try:
        for unit in units:
            for name, array in unit.run().items():
                writers[where[name]].write(name, array)
            if bar is not None:
                bar.update(unit.nbytes)
    except BaseException:
        for writer in writers.values():
            writer.close(check=False)
        raise
    finally:
        if bar is not None:
            bar.close()
    for writer in writers.values():
        writer.close()
    sizes = {name: sum(DTYPE_BYTES[d] * int(np.prod(s)) for _, d, s in entries)
             for name, entries in files.items()}
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: f for n, f in sorted(where.items())}}
        with open(os.path.join(tmp, INDEX), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    return sum(sizes.values())


def _progress_bar(progress, total):
    if not progress:
        return None
    from tqdm import tqdm  # only for the bar

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True)


def _copy_config(path, tmp):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    shutil.copyfile(path, os.path.join(tmp, "config.json"))


@contextlib.contextmanager
def _staging(dst, overwrite, src=None):
    """A temporary directory beside dst, renamed to dst when the block succeeds and removed
    when it fails: dst is either absent or complete."""
    dst = os.path.abspath(os.fspath(dst))
    if src is not None and os.path.exists(dst) and os.path.samefile(dst, src):
        raise ValueError(f"{dst}: the output cannot be the source directory")
    if os.path.exists(dst):
        if not overwrite:
            raise FileExistsError(f"{dst} exists (overwrite=True, or --overwrite, replaces it)")
        if not os.path.isdir(dst):
            raise FileExistsError(f"{dst} exists and is not a directory")
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.partial-", dir=parent)
    try:
        yield tmp
        if os.path.exists(dst):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=parent)
            os.rename(dst, os.path.join(old, "dst"))
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
