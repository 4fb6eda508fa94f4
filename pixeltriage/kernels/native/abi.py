"""The C kernels' ABI as abi.h declares it: read once, it binds a loaded library with ctypes and writes the checks a
build compiles beside the sources (`check_source`). Standard library only: the package build (setup.py) loads this
file on its own, before anything is installed.

abi.h is written in a small subset of C (its first comment says which); a construct outside it is a ValueError
naming the line, and a reading that differs from the C compiler's (a field offset, a parameter's type, an enum value)
fails the build through `check_source`'s static assertions.
"""
from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

HEADER = Path(__file__).with_name("abi.h")

# C scalar type -> ctypes type; every pointer to one of these (or to void) is a c_void_p: the callers pass
# tensors' data_ptr() or None
SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "uint32_t": ctypes.c_uint32, "uint64_t": ctypes.c_uint64,
           "float": ctypes.c_float, "double": ctypes.c_double, "uint8_t": ctypes.c_uint8, "uint16_t": ctypes.c_uint16}
POINTEES = {*SCALARS, "void"}
TAGS = ("reference", "query", "test", "declines")


@dataclass(frozen=True)
class Decl:
    """One parameter or field: its C type as written (`const float *`, `pt_delta_args`) and its name."""
    ctype: str
    name: str

    @property
    def base(self) -> str:
        return self.ctype.replace("const ", "").replace("*", "").strip()

    @property
    def pointer(self) -> bool:
        return self.ctype.endswith("*")


@dataclass(frozen=True)
class Member:
    """An enum member: its C name, value, Python key and description (from `/* key: text */`)."""
    cname: str
    value: int
    key: str
    text: str


@dataclass(frozen=True)
class Enum:
    name: str
    members: tuple[Member, ...]

    def by_key(self) -> dict[str, int]:
        return {m.key: m.value for m in self.members}


@dataclass(frozen=True)
class Function:
    """An entry point: its parameters, and the tags of its comment (reference or query, tests, declines)."""
    name: str
    params: tuple[Decl, ...]
    reference: str | None
    query: str | None
    tests: tuple[str, ...]
    declines: dict[str, str]

    @property
    def threaded(self) -> bool:
        """Whether its last parameter is the thread count (`kernels.native.call` passes it)."""
        return bool(self.params) and self.params[-1] == Decl("int", "nthreads")


@dataclass(frozen=True)
class Abi:
    enums: dict[str, Enum]
    structs: dict[str, tuple[Decl, ...]]
    functions: dict[str, Function]

    @functools.cached_property
    def status(self) -> Enum:
        return self.enums["pt_status"]

    def ctype(self, decl: Decl):
        """The ctypes type a parameter or field is passed as."""
        if decl.pointer:
            if decl.base in self.structs:
                return ctypes.POINTER(self.struct(decl.base))
            return ctypes.c_void_p
        if decl.base in self.structs:
            return self.struct(decl.base)
        return SCALARS[decl.base]

    @functools.cached_property
    def _classes(self) -> dict[str, type[ctypes.Structure]]:
        classes: dict[str, type[ctypes.Structure]] = {}
        for name, fields in self.structs.items():            # in the header's order: a field's struct comes first
            layout = [(f.name, ctypes.c_void_p if f.pointer and f.base not in classes else
                       ctypes.POINTER(classes[f.base]) if f.pointer else classes.get(f.base) or SCALARS[f.base])
                      for f in fields]
            classes[name] = type(name, (ctypes.Structure,), {"_fields_": layout})
        return classes

    def struct(self, name: str) -> type[ctypes.Structure]:
        """The ctypes Structure of struct `name`, its fields in the header's order."""
        return self._classes[name]

    def bind(self, lib: ctypes.CDLL, names: Sequence[str] | None = None) -> ctypes.CDLL:
        """Set the argument and result types of the entry points `names` (None: all) on `lib` (AttributeError for
        one it lacks)."""
        for name in self.functions if names is None else names:
            fn = self.functions[name]
            f = getattr(lib, fn.name)
            f.argtypes = [self.ctype(p) for p in fn.params]
            f.restype = ctypes.c_int
        return lib

    def check_source(self, names: Sequence[str] | None = None) -> str:
        """C source that compiles only where the compiler reads abi.h as this module did: each struct's size and field
        offsets as ctypes lays them out, each entry point's type as read here (those of `names`, the entry points a
        build defines; None: all), each enum member's value."""
        lines = ["/* Written by kernels/native/abi.py for each build: abi.h as the ctypes bindings read it. */",
                 "#include <stddef.h>", '#include "abi.h"',
                 '#pragma GCC diagnostic error "-Wincompatible-pointer-types"']
        for name in self.structs:
            cls = self.struct(name)
            lines.append(f'_Static_assert(sizeof({name}) == {ctypes.sizeof(cls)}, "{name}: ctypes reads '
                         f'{ctypes.sizeof(cls)} bytes");')
            for field in self.structs[name]:
                offset = getattr(cls, field.name).offset
                lines.append(f'_Static_assert(offsetof({name}, {field.name}) == {offset}, "{name}.{field.name}: '
                             f'ctypes reads offset {offset}");')
        for enum in self.enums.values():
            for m in enum.members:
                lines.append(f'_Static_assert({m.cname} == {m.value}, "{m.cname}: read as {m.value}");')
        for fn in (self.functions[n] for n in (self.functions if names is None else names)):
            params = ", ".join(p.ctype for p in fn.params) or "void"
            lines.append(f"int (*const pt_abi_{fn.name})({params}) __attribute__((unused)) = {fn.name};")
        return "\n".join(lines) + "\n"


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)


def _decls(body: str, where: str) -> list[Decl]:
    """`type a, *b;`-style declarations (fields) or `type a, type b` (parameters, sep=",") into Decls."""
    out = []
    for stmt in filter(None, (s.strip() for s in body.split(";"))):
        m = re.fullmatch(r"((?:const\s+)?\w+)\s*(.+)", stmt, flags=re.S)
        if not m:
            raise ValueError(f"{where}: cannot read {stmt!r}")
        base = m.group(1)
        for part in m.group(2).split(","):
            star, name = re.fullmatch(r"\s*(\**)\s*(\w+)\s*", part).groups()
            out.append(Decl(f"{base} {star}".strip() if star else base, name))
    return out


def _check_type(decl: Decl, structs: dict, where: str) -> None:
    ok = (decl.base in POINTEES or decl.base in structs) if decl.pointer else (decl.base in SCALARS
                                                                            or decl.base in structs)
    if not ok or decl.ctype.count("*") > 1:
        raise ValueError(f"{where}: {decl.ctype!r} {decl.name} is not a type abi.py reads")


def _tags(comment: str, name: str) -> dict[str, str]:
    """The tags that end a function's comment, each a line and the lines after it up to the next tag."""
    tags, last = {}, None
    for line in comment.splitlines():
        text = re.sub(r"^\s*(?:/\*|\*)?\s*|\s*(?:\*/)?\s*$", "", line)
        m = re.match(r"(\w+):\s*(.*)", text)
        if m and m.group(1) in TAGS:
            last = m.group(1)
            tags[last] = m.group(2)
        elif last is not None:
            tags[last] += " " + text
    if ("reference" in tags) == ("query" in tags) or "test" not in tags:
        raise ValueError(f"{name}: its comment needs `test:` and one of `reference:` or `query:`")
    return tags


def parse(text: str) -> Abi:
    """abi.h's text -> its enums, structs and entry points."""
    code = _strip_comments(text)                                  # the same length: spans carry over
    enums: dict[str, Enum] = {}
    for m in re.finditer(r"typedef enum \{(.*?)\}\s*(\w+);", code, flags=re.S):
        members = []
        for line in text[m.start(1):m.end(1)].splitlines():
            if not line.strip():
                continue
            e = re.fullmatch(r"\s*(\w+)\s*=\s*(\d+|1 << \d+),\s*/\*\s*(\w+):\s*(.*?)\s*\*/\s*", line)
            if not e:
                raise ValueError(f"enum {m.group(2)}: cannot read {line.strip()!r}")
            value = e.group(2)
            value = 1 << int(value.split("<<")[1]) if "<<" in value else int(value)
            members.append(Member(e.group(1), value, e.group(3), e.group(4)))
        enums[m.group(2)] = Enum(m.group(2), tuple(members))
    structs: dict[str, tuple[Decl, ...]] = {}
    for m in re.finditer(r"typedef struct \{(.*?)\}\s*(\w+);", code, flags=re.S):
        fields = _decls(m.group(1), m.group(2))
        for f in fields:
            _check_type(f, structs, m.group(2))
        structs[m.group(2)] = tuple(fields)
    functions: dict[str, Function] = {}
    for m in re.finditer(r"(/\*(?:(?!\*/).)*\*/)\s*PT_API int (\w+)\((.*?)\);", text, flags=re.S):
        comment, name, params = m.groups()
        decls = [] if params.strip() == "void" else [_decls(p, name)[0] for p in params.split(",")]
        for d in decls:
            _check_type(d, structs, name)
        tags = _tags(comment, name)
        declines = {}
        for key, why in re.findall(r"(\w+) \(([^()]*(?:\([^()]*\)[^()]*)*)\)", tags.get("declines", "")):
            declines[key] = why
        known = {mem.key for mem in enums["pt_status"].members}
        if set(declines) - known:
            raise ValueError(f"{name}: declines {sorted(set(declines) - known)}, not pt_status keys {sorted(known)}")
        functions[name] = Function(name, tuple(decls), tags.get("reference"), tags.get("query"),
                                   tuple(t.strip() for t in tags["test"].split(", ")), declines)
    declared = len(re.findall(r"\bPT_API\b", code)) - 1                     # less the macro's own definition
    if declared != len(functions):
        raise ValueError(f"abi.h declares {declared} PT_API functions, {len(functions)} read (each needs its "
                         "comment right above it)")
    return Abi(enums, structs, functions)


@functools.cache
def load() -> Abi:
    """abi.h beside this file, parsed once per process."""
    return parse(HEADER.read_text(encoding="utf-8"))
