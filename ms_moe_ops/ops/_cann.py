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
process loaded libascendcl.so from). A kernel is installed when one library exports both
`aclnnX` and `aclnnXGetWorkspaceSize`; the libraries' symbol tables are read from their files
(ELF .dynsym), nothing is loaded.
"""
import configparser
import functools
import glob
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
    """The names an ELF shared library exports (its defined dynamic symbols); empty for a file
    that is not one."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return frozenset()
    return frozenset(_elf_dynamic_symbols(data))


def _elf_dynamic_symbols(data):
    if data[:4] != b"\x7fELF":
        return []
    is64, little = data[4] == 2, data[5] == 1
    end = "<" if little else ">"
    if is64:
        shoff, = struct.unpack_from(end + "Q", data, 0x28)
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x3A)
        section = end + "IIQQQQIIQQ"
        symbol, symsize = end + "IBBHQQ", 24
    else:
        shoff, = struct.unpack_from(end + "I", data, 0x20)
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x2E)
        section = end + "IIIIIIIIII"
        symbol, symsize = end + "IIIBBH", 16
    sections = [struct.unpack_from(section, data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for sh in sections:
        if sh[1] != 11:  # SHT_DYNSYM
            continue
        offset, size, link = sh[4], sh[5], sh[6]
        strtab = sections[link][4]
        for i in range(size // symsize):
            fields = struct.unpack_from(symbol, data, offset + i * symsize)
            name_at = fields[0]
            shndx = fields[3] if is64 else fields[5]
            if shndx == 0 or name_at == 0:  # undefined: imported, not exported
                continue
            stop = data.index(b"\0", strtab + name_at)
            names.append(data[strtab + name_at:stop].decode("ascii", "replace"))
    return names


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
