"""The builds of the C library: which exist, what each is compiled with, which one a CPU runs, and how one is built.

On x86-64 the library is built once per instruction-set level (`X86_64`, best first) and the first whose
instruction sets the CPU has (`pt_cpu_features`: CPUID, what the OS saves, and for AMX the tile state Linux grants
the process) is loaded, as ggml's CPU backend and oneDNN pick their code paths; a CPU below x86-64-v3, or another
architecture, runs `portable()` (the compiler's baseline target). The emulated build (`emulated()`, isa_emulation.h
in place of the CPU's AVX-512 and AMX instructions) is the portable one with every such path compiled in, for the
tests. The probe (`probe()`, features.c alone) answers pt_cpu_features before any of them is chosen.

setup.py builds all of them (`all_builds`) into PREBUILT, with MANIFEST; a source checkout without them builds the
one it needs on first use (kernels.native). Standard library only: setup.py loads this file (and abi.py) on its
own, before anything is installed.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

HERE = Path(__file__).parent
SOURCES = tuple(sorted(HERE.glob("*.c")))          # one file per op family (abi.h names each one's functions)
HEADERS = tuple(sorted(HERE.glob("*.h")))
PREBUILT = HERE / "prebuilt"                         # where the package build puts the libraries
MANIFEST = "manifest.json"                          # beside them: what each was built from and with

# Every build's flags besides its target. -fno-trapping-math: nothing here reads the floating-point exception
# flags, and with them kept GCC does not if-convert the clamps and selects of the scalar loops (exp, SiLU), so e.g.
# the AVX2 build's conv stayed scalar (its bench-small delta pass 0.61x with the flag; outputs bit-identical).
# -fvisibility=hidden: abi.h's PT_API functions alone are exported; -Werror=missing-prototypes: every function a
# source defines for another is declared in a header (abi.h for the entry points).
FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd",
         "-fvisibility=hidden", "-Werror=missing-prototypes")
# every symbol resolved at link time: an entry point abi.h declares and no source defines fails the build
LINK_FLAGS = ("-Wl,-z,defs", "-lm")
# the emulated build's (isa.h); its 64-byte vectors between inline functions draw GCC's ABI note, which means nothing
EMULATION_FLAGS = ("-DPT_ISA_EMULATION", "-Wno-psabi")


@dataclass(frozen=True)
class Variant:
    """One build: its name, its target flags, the instruction sets (abi.h's pt_feature keys) a CPU needs to run it,
    and the sources it is built from."""
    name: str
    target: tuple[str, ...]
    needs: frozenset[str]
    sources: tuple[Path, ...] = SOURCES
    emulated: bool = False

    @property
    def flags(self) -> tuple[str, ...]:
        return (*FLAGS, *self.target, *(EMULATION_FLAGS if self.emulated else ()))

    @property
    def filename(self) -> str:
        return f"pixeltriage_{self.name}.so"


# x86-64-v3 (Haswell, Zen 1 on): AVX2, FMA and the bit instructions GCC's -march=x86-64-v3 assumes
V3 = frozenset({"avx2", "fma", "bmi1", "bmi2", "f16c", "lzcnt", "movbe"})
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}          # x86-64-v4 (Skylake-X, Zen 4)
X86_64 = (
    Variant("amx", ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"), V4 | {"avx512_bf16", "amx"}),
    Variant("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16"), V4 | {"avx512_bf16"}),
    Variant("x86-64-v4", ("-march=x86-64-v4",), V4),
    Variant("x86-64-v3", ("-march=x86-64-v3",), V3),
)
PORTABLE_TARGET = {"x86_64": ("-march=x86-64", "-mtune=generic")}     # elsewhere the compiler's own default


def machine() -> str:
    return platform.machine().lower()


def portable(arch: str | None = None) -> Variant:
    return Variant("portable", PORTABLE_TARGET.get(arch or machine(), ()), frozenset())


def emulated(arch: str | None = None) -> Variant:
    base = portable(arch)
    return Variant("emulated", base.target, base.needs, emulated=True)


def probe(arch: str | None = None) -> Variant:
    """features.c alone, at the portable target: pt_cpu_features (and the build queries) on any CPU."""
    return Variant("probe", portable(arch).target, frozenset(), sources=(HERE / "features.c",))


def kernels(arch: str | None = None) -> tuple[Variant, ...]:
    """This architecture's kernel builds, best first, the portable one last."""
    return (*(X86_64 if (arch or machine()) in ("x86_64", "amd64") else ()), portable(arch))


def all_builds(arch: str | None = None) -> tuple[Variant, ...]:
    """What the package build makes: the probe, every kernel build and the emulated one."""
    return (probe(arch), *kernels(arch), emulated(arch))


def choose(features: Iterable[str], arch: str | None = None) -> Variant:
    """The first of `kernels` whose instruction sets are all among `features` (the CPU's)."""
    have = frozenset(features)
    return next(v for v in kernels(arch) if v.needs <= have)


def sources_key() -> str:
    """A digest of the sources and headers a build reads (a prebuilt library is used only while they match)."""
    import hashlib

    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def compile(cc: str, variant: Variant, out: Path, check: str = "", extra: Sequence[str] = ()) -> bool:
    """Build `variant` (its sources, the C text `check` beside them, `extra` flags) into the library `out`,
    atomically: concurrent builders each rename a complete file into place. Each source is compiled on its own
    (`-c`, as one compiler invocation over all of them does, a few at a time on this machine's cores), then linked
    once. With OpenMP where the compiler has it (GCC: libgomp, which resolves to the copy torch has loaded), else
    without (one thread): returns which. RuntimeError with the compiler's messages where neither builds."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    work = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))     # the objects, and the check's source
    sources, include = list(variant.sources), []
    if check:                        # under one name wherever it is built: the same library's bytes from any build
        (work / "abi_check.c").write_text(check)
        sources.append(work / "abi_check.c")
        include = [f"-I{HERE}"]
    try:
        errors = []
        for openmp in (["-fopenmp"], []):              # without OpenMP the pragmas are ignored: one thread
            failed = _compile_and_link(cc, [*variant.flags, *extra, *openmp], include, sources, work, tmp)
            if not failed:
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o755 & ~umask)       # mkstemp made it 0600: readable by every user of a cache
                os.replace(tmp, out)
                return bool(openmp)
            errors.append(failed)
        raise RuntimeError("\n".join(errors))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        shutil.rmtree(work, ignore_errors=True)


def _compile_and_link(cc: str, flags: list[str], include: list[str], sources: list[Path], work: Path,
                      library: str) -> str:
    """Compile each of `sources` into an object in `work`, the largest first, on a pool as wide as the cores this
    process may run on, then link the objects into `library`: the compiler's messages of the step that failed, ""
    where none did."""
    def run(cmd: list[str]) -> str:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        return "" if r.returncode == 0 else f"$ {' '.join(cmd)}\n{r.stderr.strip()[-2000:]}"

    objects = [str(work / f"{source.stem}.o") for source in sources]
    commands = [[cc, *flags, *include, "-c", str(source), "-o", obj] for source, obj in zip(sources, objects)]
    order = sorted(range(len(sources)), key=lambda i: -sources[i].stat().st_size)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max(1, min(len(sources), cores))) as pool:
        failures = [f for f in pool.map(run, [commands[i] for i in order]) if f]
    if failures:
        return "\n".join(failures)
    return run([cc, *flags, *objects, "-o", library, *LINK_FLAGS])


def compiler_id(cc: str) -> str:
    """The compiler as its first line of `--version` says (GCC's or clang's name and version)."""
    try:
        r = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
        return r.stdout.splitlines()[0].strip() if r.returncode == 0 and r.stdout else cc
    except (OSError, subprocess.SubprocessError):
        return cc


def prebuilt(variant: Variant, directory: Path | None = None) -> Path | None:
    """The package build's library of `variant` in `directory` (None: PREBUILT), where its manifest says it was built
    from these sources (an edited source checkout builds anew instead) with these flags, on this architecture; else
    None."""
    directory = PREBUILT if directory is None else directory
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    entry = manifest.get("builds", {}).get(variant.name)
    path = directory / variant.filename
    if (entry is None or entry.get("flags") != list(variant.flags) or manifest.get("machine") != machine()
            or manifest.get("sources") != sources_key() or not path.is_file()):
        return None
    return path
