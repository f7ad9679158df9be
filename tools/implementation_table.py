"""Regenerates the implementation table of docs/ascend.md from the operator declarations.

    python tools/implementation_table.py          # prints it
    python tools/implementation_table.py --write  # writes it between the markers of docs/ascend.md
    python tools/implementation_table.py --check  # exit status 1 when docs/ascend.md's differs

The table depends on the declarations alone (where each implementation runs), never on what is
installed here: the same on a host with or without CANN.
"""
import os
import sys

from ms_moe_ops.ops._table import ascend_table

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "ascend.md")
BEGIN, END = "<!-- implementation table: begin -->", "<!-- implementation table: end -->"


def with_table(text):
    before, rest = text.split(BEGIN)
    _, after = rest.split(END)
    return f"{before}{BEGIN}\n{ascend_table()}\n{END}{after}"


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        with open(DOC, encoding="utf-8") as f:
            text = f.read()
        with open(DOC, "w", encoding="utf-8") as f:
            f.write(with_table(text))
    elif "--check" in sys.argv[1:]:
        with open(DOC, encoding="utf-8") as f:
            text = f.read()
        if with_table(text) != text:
            print("docs/ascend.md's implementation table differs from the declarations': run "
                  "python tools/implementation_table.py --write")
            sys.exit(1)
    else:
        print(ascend_table())
