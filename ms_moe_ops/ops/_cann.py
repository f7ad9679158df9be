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
"""
import configparser
import functools
import glob
import mmap
import os
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
