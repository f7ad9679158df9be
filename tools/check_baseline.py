"""Proves from the disassembly that the generic path of an x86-64 kernel library runs on any
x86-64 CPU: no function it can reach executes an instruction beyond the x86-64 baseline (SSE2).

The roots are the exported functions (the entry points choose a path at run time through a table
of pointers, which this walk does not follow) and every function of the generic path
(moe::isa_generic). From them it follows every function named in a call, jump or address
(OpenMP bodies are passed by address). AVX/AVX-512 code (VEX/EVEX instructions, ymm/zmm/mask
registers) and the SSE3/SSSE3/SSE4, POPCNT, LZCNT/TZCNT, BMI and MOVBE instructions must appear
only in functions it cannot reach: those of the avx2 and avx512 paths.

    python tools/check_baseline.py ms_moe_ops/_kernels*.so     (exit 1 and a list if not)
"""
import re
import subprocess
import sys

BEYOND_BASELINE = re.compile(
    r"^(v\w+|popcnt|lzcnt|tzcnt|andn|bextr|blsi|blsr|blsmsk|bzhi|pdep|pext|rorx|sarx|shlx|shrx|"
    r"movbe|pshufb|palignr|pabs[bwd]|psign[bwd]|phadd\w*|phsub\w*|pmaddubsw|pmulhrsw|pmulld|"
    r"pmuldq|pmin[su][bwd]|pmax[su][bwd]|pblend\w*|blend\w*|round[sp][sd]|ptest|pmov[sz]x\w*|"
    r"pcmpeqq|pcmpgtq|packusdw|pextr[bdq]|pinsr[bdq]|insertps|extractps|dp[sp][sd]|mpsadbw|"
    r"phminposuw|movntdqa|crc32\w*|pcmp[ei]str\w*|hadd[sp][sd]|hsub[sp][sd]|movddup|movshdup|"
    r"movsldup|lddqu|addsub[sp][sd]|fisttp\w*)$")
WIDE_REGISTERS = re.compile(r"%[yz]mm\d|%k[0-7]\b")


def functions(library):
    """{function: (instructions beyond the baseline, names it refers to)} from objdump."""
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", library],
                         capture_output=True, text=True, check=True).stdout
    out, current = {}, None
    for line in dis.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            current = head.group(1)
            out[current] = ([], set())
            continue
        fields = line.split("\t")
        if current is None or len(fields) < 2 or not fields[1].strip():
            continue
        ins = fields[1].strip()
        if BEYOND_BASELINE.match(ins.split()[0]) or WIDE_REGISTERS.search(ins):
            out[current][0].append(ins)
        out[current][1].update(ref for ref in re.findall(r"<([^>+]+)(?:\+0x[0-9a-f]+)?>", ins)
                               if ref != current)
    return out


def exported(library):
    listing = subprocess.run(["nm", "-D", "--defined-only", "-C", library],
                             capture_output=True, text=True, check=True).stdout
    return {line.split(" ", 2)[2] for line in listing.splitlines() if line.split(" ")[1] in "TW"}


def violations(library):
    """{function reachable from the generic path: its first instructions beyond the baseline}."""
    funcs = functions(library)
    roots = exported(library)
    stack = [f for f in funcs if f in roots or "isa_generic::" in f]
    seen = set()
    while stack:
        f = stack.pop()
        if f in seen or f not in funcs:
            continue
        seen.add(f)
        stack.extend(funcs[f][1])
    if not any("isa_generic::" in f for f in seen):
        raise ValueError(f"{library}: no function of the generic path found (not this library?)")
    return {f: funcs[f][0][:3] for f in sorted(seen) if funcs[f][0]}


def main(argv):
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    bad = violations(argv[0])
    for f, ins in bad.items():
        print(f"{f}: {'; '.join(ins)}")
    print(f"{len(bad)} function(s) of the generic path go beyond x86-64" if bad else
          "the generic path uses only x86-64 baseline instructions")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
