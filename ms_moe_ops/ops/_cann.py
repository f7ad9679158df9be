"""Which aclnn kernels the installed CANN has, found without calling or even loading them.

Some kernels this package binds exist only in some CANN releases (aclnnMoeGatingTopKBackward and
aclnnSwigluGroupQuantGrad appear in 2026 sources only). MindSpore selects a Custom aclnn kernel
by looking its symbols up in the op-api libraries, and fails on the device when they are missing;
the resolver asks here first and falls back, saying why.

Where MindSpore 2.10 looks (its op-api loader): every `$ASCEND_CUSTOM_OPP_PATH` entry's
`op_api/lib/libcust_opapi.so`; `<root>/opp/vendors/<vendor>/op_api/lib/libcust_opapi.so` in the
`load_priority` order of `<root>/opp/vendors/config.ini`; every `<root>/lib64/libopapi_*.so` and
`<root>/lib64/libopapi.so`, root being the CANN install (the toolkit directory of
`$ASCEND_HOME_PATH`, `$ASCEND_TOOLKIT_HOME`, the parent of `$ASCEND_OPP_PATH`, or where the
process loaded libascendcl.so from). A kernel is installed when one library, with the libraries
of its own directory it needs, exports both `aclnnX` and `aclnnXGetWorkspaceSize`; the symbol
tables are read from the files (ELF .dynsym and DT_NEEDED), nothing is loaded.

Two more checks, because a symbol is not enough (`kernel_missing`):
- the prototype: MindSpore types a call from the installed header (its Custom route parses
  `aclnnop/aclnn_<snake>.h`; the C++ extension route compiles against it), and headers change
  between releases (aclnnSwigluGroupQuantGrad's groupIndexOptional was an aclIntArray in early
  Ascend 950 releases, an aclTensor later). The binding's C types must be the header's.
- the SoC: the op-info files of the installed CANN
  (`opp/built-in/op_impl/ai_core/tbe/config/<soc>/aic-<soc>-ops-info.json`, and the same under
  each vendor's `opp/vendors/<vendor>/op_impl`, keyed by operator type)
  say which SoC a kernel is built for; a symbol exported for every SoC can still lack the kernel
  of this one (one revision of aclnnMoeGatingTopKBackward's document lists Ascend 950 as
  unsupported).
"""
import configparser
import functools
import glob
import json
import mmap
import os
import re
import struct

ROOT_ENV = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")


def roots(environ=None):
    """The CANN install directories this process would use, most specific first."""
    environ = os.environ if environ is None else environ
    found = [environ[name] for name in ROOT_ENV if environ.get(name)]
    if environ.get("ASCEND_OPP_PATH"):
        found.append(os.path.dirname(os.path.normpath(environ["ASCEND_OPP_PATH"])))
    found += _loaded_acl_roots()
    return list(dict.fromkeys(os.path.normpath(r) for r in found))


def _loaded_acl_roots():
    """CANN roots of an ACL library already mapped into this process (MindSpore loads it when
    the Ascend device is set): the path up to its lib64 directory."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libascendcl" in line}
    except OSError:
        return []
    return sorted({p.split(os.sep + "lib64" + os.sep)[0] for p in paths if os.sep + "lib64" in p})


def op_api_libraries(environ=None):
    """The op-api libraries MindSpore would search, in its order."""
    environ = os.environ if environ is None else environ
    libs = []
    for entry in filter(None, environ.get("ASCEND_CUSTOM_OPP_PATH", "").split(os.pathsep)):
        libs.append(os.path.join(entry, "op_api", "lib", "libcust_opapi.so"))
    for root in roots(environ):
        vendors = os.path.join(root, "opp", "vendors")
        for vendor in _vendor_priority(os.path.join(vendors, "config.ini")):
            libs.append(os.path.join(vendors, vendor, "op_api", "lib", "libcust_opapi.so"))
        libs += sorted(glob.glob(os.path.join(root, "lib64", "libopapi_*.so")))
        libs.append(os.path.join(root, "lib64", "libopapi.so"))
    return [lib for lib in dict.fromkeys(libs) if os.path.isfile(lib)]


def _vendor_priority(config):
    parser = configparser.ConfigParser()
    try:
        with open(config) as f:
            parser.read_string("[vendors]\n" + f.read())
    except (OSError, configparser.Error):
        return []
    order = parser.get("vendors", "load_priority", fallback="")
    return [v.strip() for v in order.split(",") if v.strip()]


@functools.lru_cache(maxsize=None)
def exported_symbols(path):
    """The names an ELF shared library exports (its defined dynamic symbols), with those of the
    libraries it needs from its own directory (MindSpore's dlsym on its handle finds them too);
    empty for a file that is not one."""
    names, needed = _read_elf(path)
    folder = os.path.dirname(path)
    for lib in needed:
        if os.path.isfile(os.path.join(folder, lib)):
            names |= _read_elf(os.path.join(folder, lib))[0]
    return frozenset(names)


def _read_elf(path):
    """(defined dynamic symbol names, DT_NEEDED library names) of an ELF file."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _elf_dynamic(data)
    except (OSError, ValueError, struct.error):  # unreadable, empty or truncated
        return set(), []


def _elf_dynamic(data):
    if data[:4] != b"\x7fELF":
        return set(), []
    is64, little = data[4] == 2, data[5] == 1
    end = "<" if little else ">"
    if is64:
        shoff, = struct.unpack_from(end + "Q", data, 0x28)
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x3A)
        section, symbol, symsize, dyn = end + "IIQQQQIIQQ", end + "IBBHQQ", 24, end + "qQ"
    else:
        shoff, = struct.unpack_from(end + "I", data, 0x20)
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x2E)
        section, symbol, symsize, dyn = end + "IIIIIIIIII", end + "IIIBBH", 16, end + "iI"
    sections = [struct.unpack_from(section, data, shoff + i * shentsize) for i in range(shnum)]

    def string(table, at):
        stop = data.find(b"\0", table + at)
        return data[table + at:stop].decode("ascii", "replace")

    names, needed = set(), []
    for sh in sections:
        kind, offset, size, link = sh[1], sh[4], sh[5], sh[6]
        strtab = sections[link][4]
        if kind == 11:  # SHT_DYNSYM: the symbols defined here are exported
            for i in range(size // symsize):
                fields = struct.unpack_from(symbol, data, offset + i * symsize)
                shndx = fields[3] if is64 else fields[5]
                if shndx and fields[0]:
                    names.add(string(strtab, fields[0]))
        elif kind == 6:  # SHT_DYNAMIC: DT_NEEDED (tag 1) entries name the libraries needed
            step = struct.calcsize(dyn)
            for i in range(size // step):
                tag, value = struct.unpack_from(dyn, data, offset + i * step)
                if tag == 1:
                    needed.append(string(strtab, value))
    return names, needed


def missing_kernel(kernel, environ=None):
    """'' when an op-api library of the installed CANN exports `kernel` and its
    GetWorkspaceSize, else why not (no CANN found, or the libraries searched)."""
    libs = op_api_libraries(environ)
    if not libs:
        return (f"no CANN op-api library found (set ASCEND_HOME_PATH, e.g. by sourcing CANN's "
                f"set_env.sh), so {kernel} cannot be called")
    wanted = {kernel, kernel + "GetWorkspaceSize"}
    for lib in libs:
        if wanted <= exported_symbols(lib):
            return ""
    return (f"the installed CANN does not have {kernel} (not exported by "
            f"{', '.join(os.path.basename(lib) for lib in libs)})")


@functools.lru_cache(maxsize=None)
def kernel_missing(kernel):
    """missing_kernel for this process's environment, found once."""
    return missing_kernel(kernel)


def header_folders(environ=None):
    """The folders that hold aclnn headers, in MindSpore's search order: each custom op-api
    directory (`$ASCEND_CUSTOM_OPP_PATH/*/op_api/include`), each vendor's by load priority
    (`opp/vendors/<vendor>/op_api/include`: kernels installed as custom packages), then the
    toolkit's `include/aclnnop`; only those that exist."""
    environ = os.environ if environ is None else environ
    folders = [os.path.join(e, "op_api", "include")
               for e in filter(None, environ.get("ASCEND_CUSTOM_OPP_PATH", "").split(os.pathsep))]
    for root in roots(environ):
        vendors = os.path.join(root, "opp", "vendors")
        folders += [os.path.join(vendors, v, "op_api", "include")
                    for v in _vendor_priority(os.path.join(vendors, "config.ini"))]
        folders.append(os.path.join(root, "include", "aclnnop"))
    return [f for f in dict.fromkeys(folders) if os.path.isdir(f)]


def header_paths(kernel, header, environ=None):
    """Where the installed CANN keeps the header of `kernel`, in MindSpore's search order."""
    return [os.path.join(f, header) for f in header_folders(environ)
            if os.path.isfile(os.path.join(f, header))]


def prototype_types(text, kernel):
    """The parameter types of `<kernel>GetWorkspaceSize(...)` in a header's text, const, struct
    and spaces removed ('aclTensor*', 'int64_t', ...), or None when it is not declared. Comments,
    line breaks, `const` on either side of the `*`, default arguments and export macros
    (ACLNN_API, __attribute__((...))) do not matter."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)  # preprocessor lines (macro definitions)
    match = re.search(r"\baclnnStatus\b[^;{}()]*?\b" + re.escape(kernel) +
                      r"GetWorkspaceSize\s*\(([^()]*)\)", text)
    if match is None:
        return None
    types = []
    for param in match.group(1).split(","):
        param = param.split("=")[0]  # a default argument
        param = re.sub(r"\b(const|struct|volatile|ACLNN_API)\b", " ", param).strip()
        found = re.match(r"([A-Za-z_]\w*)\s*((?:\*\s*)*)", param)
        types.append(found.group(1) + found.group(2).replace(" ", "") if found else param)
    return [] if types == ["void"] or types == [""] else types


def header_mismatch(kernel, header, types, environ=None):
    """'' when the installed header of `kernel` declares `types` (the C types a binding passes,
    outputs, workspaceSize and executor included), else why not; '' too when no header is
    installed (MindSpore's Custom route then types the call from the registration)."""
    for path in header_paths(kernel, header, environ):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                declared = prototype_types(f.read(), kernel)
        except OSError:
            continue
        wanted = [t.replace(" ", "").replace("const", "") for t in types]
        if declared is not None and declared != wanted:
            return (f"the installed header {path} declares {kernel}GetWorkspaceSize({', '.join(declared)}), "
                    f"the binding passes ({', '.join(wanted)})")
        if declared is not None:
            return ""
    return ""


# The operator type of each bound aclnn API when it is not the API's name (the op-info files and
# the kernel packages are keyed by it): aclnnFFN, FFNV2 and FFNV3 are interfaces of the FFN
# operator; aclnnMoeFFN is the older interface whose computation FFN now provides (CANN
# ops-transformer ffn/ffn/README.md), listed under either name.
_OP_TYPES = {"aclnnMoeFFN": ("MoeFFN", "FFN")}


def op_types(kernel):
    """The operator types an aclnn API may be listed under in the op-info files:
    aclnnMoeGatingTopK -> (MoeGatingTopK,), aclnnFFNV3 -> (FFN,)."""
    if kernel in _OP_TYPES:
        return _OP_TYPES[kernel]
    return (re.sub(r"V\d+$", "", kernel[len("aclnn"):] if kernel.startswith("aclnn") else kernel),)


def op_type(kernel):
    """The operator type of an aclnn API (the first of op_types)."""
    return op_types(kernel)[0]


def soc_folders(soc_version):
    """The op-info folder names of a SoC, from MindSpore's short name (ascend950, ascend910b,
    ascend910_93) or CANN's full name (Ascend950PR_9599, Ascend910B3, Ascend910_9391): CANN
    keys its op-info by the short name; Ascend 950 appeared as ascend910_95 in early packages."""
    name = soc_version.lower()
    if name.startswith(("ascend950", "ascend910_95")):
        return ("ascend950", "ascend910_95")
    if name.startswith("ascend910_93"):
        return ("ascend910_93",)
    if name.startswith("ascend910b"):
        return ("ascend910b",)
    return (name,)


def op_info_roots(environ=None):
    """The op_impl folders whose op-info files list kernels: every custom opp path, every vendor
    (custom kernel packages), the built-in one."""
    environ = os.environ if environ is None else environ
    found = [os.path.join(e, "op_impl")
             for e in filter(None, environ.get("ASCEND_CUSTOM_OPP_PATH", "").split(os.pathsep))]
    for root in roots(environ):
        vendors = os.path.join(root, "opp", "vendors")
        found += [os.path.join(vendors, v, "op_impl")
                  for v in _vendor_priority(os.path.join(vendors, "config.ini"))]
        found.append(os.path.join(root, "opp", "built-in", "op_impl"))
    return list(dict.fromkeys(found))


def soc_op_info(soc_version, environ=None):
    """{operator type} the installed CANN's op-info files (built-in and vendors') list for a SoC,
    or None when the installation has none for it (nothing to go by)."""
    found, any_file = set(), False
    for folder in op_info_roots(environ):
        for soc in soc_folders(soc_version):
            pattern = os.path.join(folder, "ai_core", "tbe", "**", soc, "*ops-info*.json")
            for path in glob.glob(pattern, recursive=True):
                try:
                    with open(path, encoding="utf-8") as f:
                        found |= set(json.load(f))
                    any_file = True
                except (OSError, ValueError):
                    continue
    return found if any_file else None


def soc_mismatch(kernel, soc_version, environ=None):
    """'' unless the installed CANN's op-info files for `soc_version` leave out `kernel`'s
    operator type."""
    if not soc_version:
        return ""
    listed = soc_op_info(soc_version, environ)
    if listed is None or set(op_types(kernel)) & listed:
        return ""
    return (f"the installed CANN's op-info for {soc_version} does not list {op_type(kernel)} "
            f"(the kernel is not built for this SoC)")


@functools.lru_cache(maxsize=None)
def unavailable(kernel, header="", types=(), soc_version=""):
    """Why the installed CANN cannot run `kernel` here, or '': the symbols, the header's prototype
    (when `types` are given), the SoC's op-info (when `soc_version` is)."""
    return (missing_kernel(kernel) or (header_mismatch(kernel, header, types) if types else "")
            or soc_mismatch(kernel, soc_version))
