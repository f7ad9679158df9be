"""The options of the package's public API as found in the code (tests/test_option_matrix.py
checks that every one of them has a case for each of its value classes).

`inventory()` walks the declarations themselves: every OpDef attribute (ms_moe_ops.ops.OPERATORS)
and any functional wrapper parameter that is no attribute, the fields of every config dataclass
exported by ms_moe_ops.nn, the keyword options (parameters with a default) of every exported Cell
class and function of ms_moe_ops.nn and ms_moe_ops.parallel, and every field and option of every
family preset (ms_moe_ops.nn.families.FAMILIES). Variadic parameters (`*args`, `**options`,
`**overrides`) are not options of their own: they pass the config fields enumerated here.
"""
import dataclasses
import inspect

from ms_moe_ops import nn as moe_nn, ops as moe_ops, parallel
from ms_moe_ops.nn import families

# a Cell's own first parameter: its config, whose fields are enumerated as the config's options
_CONFIG_PARAMETERS = {"config"}


def _keyword_options(obj):
    """Names and defaults of obj's parameters that have a default (obj: a function or class)."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin (an exception class): no options of its own
        return {}
    return {name: p.default for name, p in signature.parameters.items()
            if p.default is not inspect.Parameter.empty and name not in _CONFIG_PARAMETERS
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def inventory():
    """{option id: (where it was found, its default)}.

    Ids: "<op>.<attr>" (OpDef attributes), "<wrapper>(<param>)" (a functional wrapper's parameter
    that is no attribute of its OpDef), "<Config>.<field>" (config dataclasses),
    "<Name>(<param>)" (keyword options of Cells and functions), "FAMILIES[<family>].<field>" and
    "FAMILIES[<family>].options.<option>" (family presets)."""
    found = {}
    by_name = {op.name: op for op in moe_ops.OPERATORS}
    for op in moe_ops.OPERATORS:
        for attr in op.attrs:
            found[f"{op.name}.{attr.name}"] = (f"OpDef {op.name}.attrs", attr.default)
    for name in moe_ops.__all__:
        op = by_name.get(name)
        known = set(op.inputs) | {a.name for a in op.attrs} if op is not None else set()
        for param, default in _keyword_options(getattr(moe_ops, name)).items():
            if param not in known:
                found[f"{name}({param})"] = (f"ms_moe_ops.ops.{name} signature", default)
    for module in (moe_nn, parallel):
        for name in module.__all__:
            obj = getattr(module, name)
            if dataclasses.is_dataclass(obj):
                for f in dataclasses.fields(obj):
                    default = f.default if f.default is not dataclasses.MISSING else None
                    found[f"{name}.{f.name}"] = (f"{module.__name__}.{name} fields", default)
            elif callable(obj):
                for param, default in _keyword_options(obj).items():
                    found[f"{name}({param})"] = (f"{module.__name__}.{name} signature", default)
    for family, preset in families.FAMILIES.items():
        where = f"ms_moe_ops.nn.families.FAMILIES[{family!r}]"
        for field in preset._fields:
            if field != "options":
                found[f"FAMILIES[{family}].{field}"] = (where, getattr(preset, field))
        for option, value in {**families._OPTIONS, **preset.options}.items():
            found[f"FAMILIES[{family}].options.{option}"] = (where + ".options", value)
    return found


def family_reads_configuration(family, option):
    """Whether a family's option is read from the transformers configuration (an Attr or a
    function of it) rather than a constant."""
    value = {**families._OPTIONS, **families.FAMILIES[family].options}[option]
    return isinstance(value, families.Attr) or callable(value)
