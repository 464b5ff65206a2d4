"""Whether a built kernel library shares torch's C++ runtime: the libraries it needs, read from
its ELF dynamic section.

The kernels must call the one ``libstdc++.so.6`` that torch loaded into the process. A
toolchain with no shared libstdc++ (or ``-static-libstdc++``) links a private copy into the
library instead, unless ``-lstdc++`` comes first (``_levels.LINK_FLAGS``); the process then
holds two C++ runtimes of different versions, and the first error message that formats a
number can crash it (seen: a compiler wrapper in ``/opt/gcc`` on an x86 Xeon, SIGSEGV in
``std::ostream::operator<<(long)`` under an int8 op's argument check). ``setup.py`` refuses
such a build and the loader such a library. Plain Python (``setup.py`` loads this file by
path, before qkv is installed).
"""

from __future__ import annotations

import struct
from pathlib import Path

__all__ = ["needed_libraries", "private_runtime"]

_SHT_DYNAMIC, _DT_NULL, _DT_NEEDED = 6, 0, 1


def needed_libraries(path: str | Path) -> list[str] | None:
    """The shared libraries an ELF file names as needed (``DT_NEEDED``), in order; ``None``
    where that cannot be read (not a 64-bit little-endian ELF file, no dynamic section, cut
    short)."""
    try:
        return _needed(Path(path).read_bytes())
    except (struct.error, ValueError, IndexError, UnicodeDecodeError):  # a damaged file
        return None


def _needed(data: bytes) -> list[str] | None:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # ELFCLASS64, ELFDATA2LSB
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)

    def section(i: int) -> tuple[int, int, int, int]:  # type, offset, size, link
        _, kind, _, _, off, size, link = struct.unpack_from("<IIQQQQI", data, shoff + i * shentsize)
        return kind, off, size, link

    for i in range(shnum):
        kind, off, size, link = section(i)
        if kind != _SHT_DYNAMIC:
            continue
        _, str_off, str_size, _ = section(link)  # the dynamic section's string table
        strings = data[str_off : str_off + str_size]
        names = []
        for tag, val in struct.iter_unpack("<qQ", data[off : off + size - size % 16]):
            if tag == _DT_NULL:
                break
            if tag == _DT_NEEDED:
                names.append(strings[val : strings.index(b"\0", val)].decode())
        return names
    return None


def private_runtime(path: str | Path) -> str | None:
    """Why the kernel library at ``path`` must not be loaded beside torch: it carries its own
    copy of the C++ runtime (it does not need ``libstdc++.so``); ``None`` where it may be
    (or where its ELF header cannot tell)."""
    needed = needed_libraries(path)
    if needed is None or any(n.startswith("libstdc++.so") for n in needed):
        return None
    return (f"{Path(path).name} carries its own copy of the C++ runtime (it does not need "
            f"libstdc++.so; it needs {', '.join(needed) or 'nothing'}): its compiler linked "
            "libstdc++ statically, and two C++ runtimes in one process can crash it at "
            "the first error message. Build with a compiler that links libstdc++ dynamically, e.g. "
            "CXX=g++ CC=gcc (the system's), without -static-libstdc++")  # fmt: skip
