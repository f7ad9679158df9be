"""The compiled IR of a graph as MindSpore's front end hands it to a device (the `*validate*.ir`
file `save_graphs` writes), read into nodes a rule can inspect: primitive, arguments, input and
output types. Enough of the text format of MindSpore 2.10 for the Ascend rules
(tests/ascend_rules.py); a format change fails loudly in `read_ir` (no node found)."""
import contextlib
import glob
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

_NODE = re.compile(r"^\s+%(\d+)\(([^)]*)\) = ([A-Za-z0-9_:]+)\((.*)$")
_SIGNATURE = re.compile(r"^\s+: \((.*)\) -> \((.*)\)\s*$")
_SOURCE = re.compile(r"^\s+# In file ([^:]+):(\d+)")
_SCOPE = re.compile(r"^\s+# Fullname with scope: \(([^)]*)\)")


@dataclass
class Node:
    """One CNode: `prim` without MindSpore's "PrimFunc_" prefix (a Custom node: its reg-op name,
    e.g. "aclnnMoeGatingTopK"), `args` as written (`%12` for another node, `%para3_x` for a
    parameter, a literal such as `I64(2)`, `None` or a tuple), `inputs`/`output` the types as
    written (`<Tensor[Float32], (16, 8)>`), `attrs` the primitive attributes' text, `source` the
    innermost package file and line it came from."""
    index: int
    prim: str
    args: List[str]
    attrs: str = ""
    inputs: List[str] = field(default_factory=list)
    output: str = ""
    source: str = ""
    scope: str = ""  # "Default/..." for the forward; "Gradients/..." for what autodiff added

    def where(self):
        return f"%{self.index} {self.prim}" + (f" ({self.source})" if self.source else "")


def split_top(text, sep=","):
    """text split at `sep` outside brackets, parentheses and angle brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    tail = text[start:].strip()
    return parts + ([tail] if tail else [])


def _closing(text):
    """Index of the parenthesis closing an already opened one at the start of text, or -1 when
    text ends first (a long constant continues on the next lines)."""
    depth = 1
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i
    return -1


class Graph:
    """The nodes of one IR file, by index."""

    def __init__(self, nodes: Dict[int, Node]):
        self.nodes = nodes

    def __iter__(self):
        return iter(self.nodes.values())

    def of(self, prim):
        return [n for n in self if n.prim == prim]

    def producer(self, arg) -> Optional[Node]:
        """The node an argument `%N` refers to (None for parameters and literals)."""
        found = re.fullmatch(r"%(\d+)", arg.strip())
        return self.nodes.get(int(found.group(1))) if found else None

    def through_tuples(self, arg) -> Optional[Node]:
        """The producer of an argument, looking through MakeTuple/TupleGetItem of one element
        (GroupedMatmul takes its tensors in tuples)."""
        node = self.producer(arg)
        while node is not None and node.prim in ("MakeTuple", "TupleGetItem", "Depend", "Load"):
            node = self.producer(node.args[0])
        return node


def package_directory():
    """The directory of the imported ms_moe_ops: an IR node's source counts as the package's
    only there (a clone of the repository is a folder named ms_moe_ops too, tests included)."""
    import ms_moe_ops

    return os.path.dirname(os.path.realpath(ms_moe_ops.__file__))


def parse_ir(text, package=None) -> Graph:
    """The graph of an IR text; `package`: the package directory sources are kept from (default:
    the imported package's)."""
    nodes, last = {}, None
    package = (package or package_directory()).rstrip(os.sep) + os.sep
    lines = iter(text.splitlines())
    for line in lines:
        found = _NODE.match(line)
        if found:
            index, _, prim, rest = found.groups()
            close = _closing(rest)
            while close < 0:
                rest += " " + next(lines).strip()
                close = _closing(rest)
            args, tail = split_top(rest[:close]), rest[close + 1:]
            attrs = ""
            if "primitive_attrs: {" in tail:
                attrs = tail.split("primitive_attrs: {", 1)[1].rsplit("}", 1)[0]
            prim = prim.replace("PrimFunc_", "")
            if prim == "Custom":
                name = re.search(r'reg_op_name: "([^"]+)"', attrs)
                prim = name.group(1) if name else prim
            last = nodes[int(index)] = Node(int(index), prim, args, attrs)
            continue
        if last is None:
            continue
        signature = _SIGNATURE.match(line)
        if signature and not last.inputs and not last.output:
            last.inputs = split_top(signature.group(1))
            last.output = signature.group(2)
            continue
        scope = _SCOPE.match(line)
        if scope:
            last.scope = scope.group(1)
            continue
        source = _SOURCE.match(line)
        path = os.path.realpath(source.group(1)) if source else ""
        if path.startswith(package):
            last.source = f"{path[len(package):]}:{source.group(2)}"
    return Graph(nodes)


@contextlib.contextmanager
def saving_ir(directory):
    """GRAPH mode with the compiled IR of what runs inside saved under directory (read_ir reads
    it), then PyNative mode again. Only the validate pass's IR is written: MindSpore's
    MS_DEV_DUMP_IR_PASSES picks the passes save_graphs writes (otherwise all hundred of them,
    which doubles the time of a compilation)."""
    import mindspore as ms  # pylint: disable=import-outside-toplevel

    previous = os.environ.get("MS_DEV_DUMP_IR_PASSES")
    os.environ["MS_DEV_DUMP_IR_PASSES"] = "validate"
    ms.set_context(mode=ms.GRAPH_MODE, save_graphs=1, save_graphs_path=str(directory))
    try:
        yield
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE, save_graphs=0)
        if previous is None:
            os.environ.pop("MS_DEV_DUMP_IR_PASSES", None)
        else:
            os.environ["MS_DEV_DUMP_IR_PASSES"] = previous


def read_ir(directory) -> Tuple[Graph, str]:
    """(graph, path) of the last validate IR save_graphs wrote under directory."""
    paths = sorted(glob.glob(os.path.join(directory, "**", "*validate*.ir"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        raise AssertionError(f"no *validate*.ir under {directory}: did save_graphs change?")
    with open(paths[-1]) as f:
        graph = parse_ir(f.read())
    if not graph.nodes:
        raise AssertionError(f"no node read from {paths[-1]}: has MindSpore's IR format changed?")
    return graph, paths[-1]


# -- types as written: <Tensor[Float32], (16, 8)>, <Tuple[Tensor[Float32]], TupleShape((16, 8))>,
# <Int64, NoShape>, <None, NoShape>

def dtype_of(type_text):
    """'Float32' of a tensor (or a one-tensor tuple) type, 'Int64' of a scalar, None for None."""
    found = re.search(r"Tensor\[(\w+)\]", type_text)
    if found:
        return found.group(1)
    found = re.match(r"<(\w+),", type_text.strip())
    return None if not found or found.group(1) == "None" else found.group(1)


def shape_of(type_text):
    """The shape of a tensor type (a parameter's Ref and one-tensor tuples too) as a tuple of ints
    (-1 unknown), or None."""
    found = re.search(r"Tensor\[\w+\]\]?, \(([-\d, ]*)\)", type_text) or \
        re.search(r"TupleShape\(\(([-\d, ]*)\)\)", type_text)
    if not found:
        return None
    return tuple(int(d) for d in found.group(1).split(",") if d.strip())


def literal(arg):
    """The value of a literal argument: I64(2) -> 2, F32(1.5) -> 1.5, Bool(1) -> True,
    None -> None; anything else (a node, a parameter, a tuple) -> the text itself."""
    arg = arg.strip()
    found = re.fullmatch(r"(I64|I32|F32|F64|Bool)\((.*)\)", arg)
    if not found:
        return None if arg == "None" else arg
    kind, value = found.groups()
    if kind == "Bool":
        return value in ("1", "true", "True")
    return float(value) if kind.startswith("F") else int(value)


# -- static shapes: every dimension known when the graph is compiled --------------------------

_TENSOR_SHAPE = re.compile(r"Tensor\[\w+\]\]?, \(([-\d, ]*)\)")
_TUPLE_SHAPE = re.compile(r"TupleShape\(((?:[^()]|\([-\d, ]*\))*)\)")


def dynamic_dimensions(text):
    """The lines of an IR text whose tensor types (a parameter's, a node's inputs' or output's,
    a tuple's elements) have a dimension or rank known only at run time (-1, -2): [] for a graph
    with static shapes."""
    found = []
    for line in text.splitlines():
        shapes = _TENSOR_SHAPE.findall(line)
        for inner in _TUPLE_SHAPE.findall(line):
            shapes += re.findall(r"\(([-\d, ]*)\)", inner)
        if any(int(d) < 0 for shape in shapes for d in shape.split(",") if d.strip()):
            found.append(line.strip())
    return found
