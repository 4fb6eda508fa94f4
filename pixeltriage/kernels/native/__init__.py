"""Small C kernels for the CPU path, built with the package and loaded with ctypes.

torch runs the engine's elementwise chains as one pass over memory per op; where a chain sits between two
matmuls a C loop that keeps each row in registers does the same arithmetic in one pass. The largest is the
Gated DeltaNet's token mixing (`pt_delta_chunked`): conv1d + SiLU, L2 norms, each chunk's decays, UT inverse
and small products (register-blocked FMA outer products) and the recurrence, in one pass per head whose
working set stays in cache. The sources ship with the package (a file per op family: norm_act.c and its AVX-512
twin, conv.c, delta.c, delta_bf16.c, attention.c, attention_bf16.c, features.c, over the shared headers vec.h,
matmul.h, matmul_bf16.h; plain C11 + OpenMP, no torch headers).

The package build (setup.py) compiles them once per x86 level (`variants`: x86-64-v3, x86-64-v4, AVX512-BF16,
AMX), once portable, once emulated, into `prebuilt/`; at load the probe library reads this CPU's instruction sets
(`cpu_features`: CPUID, and for AMX the tile state Linux grants) and the best build they run is loaded
(`variant()`). A source checkout whose prebuilt libraries are missing or older than its sources builds the one it
needs on first use with the machine's C compiler (`CC`: one executable, no extra words) into the engine's cache
directory, keyed by the sources, the compiler and the flags. Built by GCC, the library links libgomp, which
resolves to the copy torch has already loaded (the same soname: it is loaded after torch), so its threads are
torch's threads; clang's `-fopenmp` links libomp instead, a second thread pool beside torch's.

Every entry point is declared once, in `abi.h` (`abi.py` binds the library from it and writes the checks each build
compiles), and called through `call`, the one place Python calls into the library: it returns 0 where the kernel
ran, else a decline code (`decline_reason`), which `kernels.registry.c_call` turns into a decline: the op's next
kernel runs the call, counted and logged once per reason. Every native kernel has a torch
implementation beside it, used when no library loads (no prebuilt one and no compiler, a failed build) or
`PIXELTRIAGE_NATIVE=0` is set; `available()` says which is in use and `status()` why. The tests compare the two.

`PIXELTRIAGE_NATIVE_ISA=emulated` (or `emulated_isa()`, for a block of code) loads the emulated build instead, with
`isa_emulation.h` in place of the CPU's AVX-512 and AMX intrinsics: every such path then runs on any CPU, slowly, so
that their tests check them on machines without the units (`isa.h` says what the sources test).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence, TypeVar

from pixeltriage import settings
from pixeltriage.errors import BackendUnavailableError
from pixeltriage.kernels.native import abi, variants

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ISA_SWITCH = "PIXELTRIAGE_NATIVE_ISA"       # "native" (the default) or "emulated"
_state: dict[str, str] = {}        # what loading each build did, by its name
_isa_override: list[bool] = []     # emulated_isa()'s, innermost last: before the environment


def _disabled() -> bool:
    return not settings.current().native


def _isa_switch() -> bool:
    """PIXELTRIAGE_NATIVE_ISA (`pixeltriage.settings`): True for "emulated"."""
    return settings.current().native_isa == "emulated"


def isa_emulated() -> bool:
    """Whether the kernels in use are the emulated build (`emulated_isa()`, else PIXELTRIAGE_NATIVE_ISA=emulated):
    AVX-512 and AMX in portable C, for tests on any CPU."""
    return _isa_override[-1] if _isa_override else _isa_switch()


T = TypeVar("T")


def per_isa(fn: Callable[[bool], T]) -> Callable[[], T]:
    """`fn(emulated)` computed once per build (the CPU's own, the emulated one); calling the result picks the one
    `isa_emulated()` says, and `.of(emulated)` a given one."""
    of = functools.cache(fn)

    @functools.wraps(fn)
    def current() -> T:
        return of(isa_emulated())

    current.of = of
    return current


@contextlib.contextmanager
def emulated_isa(on: bool = True) -> Iterator[None]:
    """Inside the block, the kernel library is the emulated build (on=True) or the one this CPU runs (False),
    whatever PIXELTRIAGE_NATIVE_ISA says; both stay loaded. Process-wide, not per thread: for
    tests and tools, not for a server with requests in flight."""
    _isa_override.append(on)
    try:
        yield
    finally:
        _isa_override.pop()


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def cpuinfo_fields(text: str | None = None) -> dict[str, str]:
    """/proc/cpuinfo's fields (or `text`'s), each key's first value: "vendor_id", "model name" and "flags" on x86,
    "Features" and "CPU implementer" on aarch64; {} where there is no such file. The one reader of the file, for
    `kernels.tuning.machine_key` and `bench.timing.cpu_machine` (the kernels' build is chosen from CPUID instead:
    `cpu_features`)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def _cpu_flags() -> str:
    fields = cpuinfo_fields()
    return fields.get("flags") or fields.get("Features") or platform.processor()


def _build_dir() -> Path:
    from pixeltriage.paths import cache_dir

    return cache_dir() / "native"


def _load(variant: variants.Variant, names: Sequence[str] | None = None) -> ctypes.CDLL | None:
    """The library of `variant`, bound from abi.h (its entry points `names`; None: all): the package's prebuilt one,
    else built here on first use (once per sources, compiler and flags) as `{prefix}_{key}.so` in the cache; None
    when disabled, not on Linux, without either, or when the build fails (`status()` says which, a warning names
    the torch implementations running instead). Loaded after torch, whose OpenMP runtime it then shares."""
    def done(status: str, lib: ctypes.CDLL | None = None) -> ctypes.CDLL | None:
        _state[variant.name] = status
        return lib

    if _disabled():
        return done("disabled by PIXELTRIAGE_NATIVE=0")
    if platform.system() != "Linux":
        return done(f"not built on {platform.system()} (Linux only)")
    check = abi.load().check_source(names)
    path, how = variants.prebuilt(variant), "prebuilt"
    try:
        if path is None:
            cc = _compiler()
            if cc is None:
                log.warning("native CPU kernels (%s): no prebuilt library and no C compiler found (set CC); using the "
                            "torch implementations", variant.name)
                return done("no prebuilt library and no C compiler found (set CC)")
            key = hashlib.sha256("\0".join([variants.sources_key(), check, _compiler_key(cc), *variant.flags,
                                            variants.machine()]).encode()).hexdigest()[:20]
            prefix = f"pixeltriage_{variant.name}"
            path, how = _build_dir() / f"{prefix}_{key}.so", "built on first use"
            if not path.is_file():
                log.info("building the native CPU kernels (%s) with %s -> %s", variant.name, cc, path)
                if not variants.compile(cc, variant, path, check):
                    log.warning("native CPU kernels (%s) built without OpenMP (%s): one thread", variant.name, cc)
                _prune(path, prefix)
        import torch  # noqa: F401  (torch's OpenMP runtime is loaded first, so the library binds to it)

        lib = abi.load().bind(ctypes.CDLL(str(path)), names)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        status = f"build or load failed: {str(e).strip()[:4000]}"
        log.warning("native CPU kernels (%s) unavailable, using the torch implementations: %s", variant.name, status)
        return done(status)
    return done(f"loaded {variant.name} ({how}): {path}", lib)


def _compiler_key(cc: str) -> str:
    """The compiler binary itself (cheaper than running `cc --version` per process)."""
    try:
        real = os.path.realpath(cc)
        st = os.stat(real)
        return f"{real}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        return cc


# the probe library's entry points (features.c alone: `variants.probe`)
PROBE = ("pt_build_features", "pt_bf16_engines", "pt_cpu_features")


@functools.cache
def cpu_features() -> frozenset[str]:
    """This CPU's instruction sets, abi.h's pt_feature keys ("avx2", "avx512f", "avx512_bf16", "amx", ...): CPUID and
    what the OS saves, read by the probe library, which asks Linux for the AMX tile state; empty where the probe
    does not load (then no kernel build does either)."""
    lib = _load(variants.probe(), PROBE)
    return frozenset() if lib is None else _features(lib, "pt_cpu_features")


def _features(lib: ctypes.CDLL, query: str) -> frozenset[str]:
    """A feature query of a library being loaded (the probe, or a build before it is put in use: `call` runs only
    the library in use) as pt_feature keys."""
    bits = ctypes.c_uint64()
    getattr(lib, query)(ctypes.byref(bits))
    return _feature_keys(bits.value)


def _feature_keys(bits: int) -> frozenset[str]:
    return frozenset(m.key for m in abi.load().enums["pt_feature"].members if bits & m.value)


def chosen(emulated: bool) -> variants.Variant:
    """The build this process loads: the emulated one, or the best this CPU runs (`variants.choose`)."""
    return variants.emulated() if emulated else variants.choose(cpu_features())


def build_status(emulated: bool | None = None) -> str:
    """What loading the build in use did (the emulated one if emulated; None: the one `isa_emulated()` says) in this
    process ("not loaded" before it was asked)."""
    return _state.get(chosen(isa_emulated() if emulated is None else emulated).name, "not loaded")


@per_isa
def library(emulated: bool) -> ctypes.CDLL | None:
    """The loaded kernel library, bound from abi.h, or None (then no op runs a C kernel): the build this CPU
    runs best (`chosen`), or the emulated one (`isa_emulated()`). A build compiled for instruction sets the CPU
    lacks (a mistake in `variants`' table) is refused before any kernel runs."""
    variant = chosen(emulated)
    lib = _load(variant)
    if lib is None or emulated:
        return lib
    missing = _features(lib, "pt_build_features") - cpu_features()
    if missing:
        _state[variant.name] = f"refused: {variant.name} is built for {sorted(missing)}, which this CPU lacks"
        log.error("native CPU kernels: %s; using the torch implementations", _state[variant.name])
        return None
    return lib


def variant() -> str | None:
    """The name of the build in use ("amx", "avx512bf16", "x86-64-v4", "x86-64-v3", "portable", or "emulated"
    under `isa_emulated()`), or None where no library is loaded."""
    return chosen(isa_emulated()).name if library() is not None else None


KEEP_BUILDS = 8     # first-use builds kept per build in the cache (other sources or compilers sharing it), newest first


def _prune(keep: Path, prefix: str) -> None:
    """Delete all but the KEEP_BUILDS most recent builds of `prefix` next to `keep` (old sources pile up across
    upgrades). A process that has one loaded keeps its mapping; a machine that needs a deleted one builds it again."""
    builds = sorted(keep.parent.glob(f"{prefix}_*.so"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [p for p in builds if p != keep][KEEP_BUILDS - 1:]:
        try:
            old.unlink()
        except OSError:
            pass


DTYPES = ("float32", "bfloat16")   # the tensor dtypes the kernels read and write (torch.<name>)


def handles(*items) -> bool:
    """Whether the library is built and takes every item: a CPU tensor of one of DTYPES, or such a dtype."""
    def ok(item) -> bool:
        dtype = getattr(item, "dtype", item)
        on_cpu = getattr(getattr(item, "device", None), "type", "cpu") == "cpu"
        return on_cpu and str(dtype).removeprefix("torch.") in DTYPES

    return all(map(ok, items)) and library() is not None


def is_bf16(t) -> int:
    """The kernels' dtype flag for `t`: 1 for bfloat16, 0 for float32."""
    return int(str(t.dtype) == "torch.bfloat16")


def checked_out(out, shape: tuple[int, ...], like):
    """`out`, where a kernel may write `shape` into it (contiguous, `like`'s dtype and device), else ValueError: the
    C passes write out's bytes as that shape whatever its strides say, so a caller's buffer is checked first."""
    if out.shape != shape or out.dtype != like.dtype or out.device != like.device or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device} (contiguous: {out.is_contiguous()}) "
                         f"is not the result's {shape} {like.dtype} on {like.device}")
    return out


# `call`'s code of its own, beside abi.h's: the entry point is named by PIXELTRIAGE_TEST_DECLINE and was not called
FORCED_DECLINE = -1


def call(kernel: str, *args) -> int:
    """Run C entry point `kernel` (abi.h) with `args`, and torch's thread count where its last parameter is nthreads:
    0 where it ran, else its decline code (`decline_reason`; a kernel declines before it writes anything, and the
    registry runs the op's next kernel: `kernels.registry.c_call`). FORCED_DECLINE, without calling it, for an entry
    point PIXELTRIAGE_TEST_DECLINE names (tests). The one place Python calls into the library.
    BackendUnavailableError where no library is loaded (callers ask `handles` or `available` first)."""
    import torch

    if kernel in settings.current().test_decline:
        return FORCED_DECLINE
    lib = library()
    if lib is None:
        raise BackendUnavailableError(f"{kernel}: the native CPU kernels are not loaded ({status()})")
    if abi.load().functions[kernel].threaded:
        args = (*args, torch.get_num_threads())
    return getattr(lib, kernel)(*args)


def struct(name: str, **fields) -> ctypes.Structure:
    """abi.h's struct `name` with every field given (TypeError for one missing or unknown): an entry point's argument
    block, passed to `call` as it is."""
    header = abi.load()
    if name not in header.structs:
        raise TypeError(f"abi.h has no struct {name!r}")
    names = [f.name for f in header.structs[name]]
    if set(fields) != set(names):
        missing, unknown = sorted(set(names) - set(fields)), sorted(set(fields) - set(names))
        raise TypeError(f"{name}: fields missing {missing}, unknown {unknown}")
    return header.struct(name)(**fields)


def query(name: str, *args) -> int | tuple[int, ...]:
    """A query entry point (abi.h: scratch sizes, the build's engines and features) with `args`, its trailing
    pointer parameters filled by the library: their value (a tuple for several)."""
    header = abi.load()
    outs = [header.ctype(abi.Decl(p.base, p.name))() for p in header.functions[name].params[len(args):]]
    code = call(name, *args, *map(ctypes.byref, outs))
    if code:
        raise RuntimeError(f"{name}{args}: {decline_reason(name, code)}")
    values = tuple(o.value for o in outs)
    return values[0] if len(values) == 1 else values


# abi.h's decline codes by key ("shape", "isa", "workspace", "argument", "dtype"): what `call` returns besides 0
DECLINE = {m.key: m.value for m in abi.load().status.members if m.value}


def decline_reason(name: str, code: int) -> str:
    """Why entry point `name` returned `code`: abi.h's words for it, e.g. "shape (T < 0, D < 1)"; "ran" for 0."""
    if code == FORCED_DECLINE:
        return "forced by PIXELTRIAGE_TEST_DECLINE"
    header = abi.load()
    member = next((m for m in header.status.members if m.value == code), None)
    if member is None:
        return f"code {code}, not one of abi.h's pt_status"
    if member.value == 0:
        return "ran"
    detail = header.functions[name].declines.get(member.key)
    return f"{member.key} ({detail})" if detail else f"{member.key}: {member.text}"


# ---- parts of a kernel's call measured inside it (the delta passes' conv + SiLU), for a profiler ----------------
_parts = threading.local()


def part_recorder() -> Callable[[str, float], None] | None:
    """Where this thread's kernels report the seconds of a named part of a call (while the engine's
    `profiling.record` records), or None: then they measure nothing."""
    return getattr(_parts, "record", None)


@contextlib.contextmanager
def recording_parts(record: Callable[[str, float], None] | None) -> Iterator[None]:
    """This thread's kernels report their parts to `record` inside the block (None: nowhere)."""
    previous = part_recorder()
    _parts.record = record
    try:
        yield
    finally:
        _parts.record = previous


@contextlib.contextmanager
def part_of_pass(name: str | None) -> Iterator[int | None]:
    """Around a C pass that takes a `prof` array ([threads, 2] float64: per thread the seconds in a part and in the
    whole pass): yields the array's address to pass, or None (pass NULL) when nobody records or `name` is None;
    after the call, reports part `name` as its share of the threads' time times the call's wall time."""
    record = part_recorder()
    if record is None or name is None:
        yield None
        return
    import torch

    prof = torch.zeros(torch.get_num_threads(), 2, dtype=torch.float64)
    start = time.perf_counter()
    yield prof.data_ptr()
    wall = time.perf_counter() - start
    part, whole = prof.sum(0).tolist()
    if part > 0 and whole > 0:
        record(name, wall * part / whole)


def available() -> bool:
    return library() is not None


# The engines of the bf16 kernels' products (`pt_delta_chunked_bf16`, the bf16 attention), by the number the kernels
# take (abi.h's pt_bf16_engine): float32 multiply-adds of the bf16 operands (any machine), AVX512-BF16 dot products,
# AMX tiles.
BF16_ENGINES = abi.load().enums["pt_bf16_engine"].by_key()
# The engines a bf16 forward's kernels run on, best first: "fma" is the others' reference, for the tests, slower
# than the float32 kernels it would replace.
FAST_BF16_ENGINES = ("amx", "avx512_bf16")


@per_isa
def bf16_engines(emulated: bool) -> frozenset[str]:
    """The bf16 engines this machine's build runs (empty without the library): the build has what `-march=native`
    found on this CPU, and AMX only once Linux has granted the process its tile state (asked here, once); the
    emulated build has all three."""
    with emulated_isa(emulated):
        if library() is None:
            return frozenset()
        bits = query("pt_bf16_engines")
    return frozenset(name for name, number in BF16_ENGINES.items() if bits >> number & 1)


@per_isa
def build_features(emulated: bool) -> frozenset[str]:
    """The instruction sets the library was compiled for (abi.h's pt_feature: "avx2", "avx512f", "avx512_bf16",
    "amx", "emulated", ...); empty without the library."""
    with emulated_isa(emulated):
        if library() is None:
            return frozenset()
        bits = query("pt_build_features")
    return frozenset(m.key for m in abi.load().enums["pt_feature"].members if bits & m.value)


def fast_bf16_engine() -> str | None:
    """The engine a bf16 forward's kernels take on this CPU (`FAST_BF16_ENGINES`, the first it has), or None."""
    have = bf16_engines()
    return next((name for name in FAST_BF16_ENGINES if name in have), None)


def on_this_engine(record: dict) -> bool:
    """Whether a kept bf16 measurement (a `kernels.tuning` record with an "engine") was taken on the engine this
    process's bf16 kernels run (`fast_bf16_engine`): `tuning.measured`'s `fits` for the bf16 records."""
    return record.get("engine") == fast_bf16_engine()


# vec_math.h's functions that `vec_math` evaluates (`pt_vec_math`'s `which`, abi.h's pt_vec_fn)
VEC_MATH = abi.load().enums["pt_vec_fn"].by_key()


def vec_math(name: str, x: torch.Tensor) -> torch.Tensor | None:
    """One of the kernels' AVX-512 vector functions (`VEC_MATH`) on a float32 CPU tensor, elementwise, for their
    tests: "exp" (e^x), "exp2_bf16" (2^x for x <= 0, the attention softmax's), "silu" and "silu_bf16" (the bf16 delta
    pass's conv). None without the library or on a build without AVX-512."""
    import torch  # here, as in build: this module loads without it

    if name not in VEC_MATH:
        raise ValueError(f"{name!r} is not one of {sorted(VEC_MATH)}")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"a float32 CPU tensor expected, got {x.dtype} on {x.device}")
    if library() is None:
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    return out if call("pt_vec_math", VEC_MATH[name], x.data_ptr(), x.numel(), out.data_ptr()) == 0 else None


def status() -> str:
    """The build in use and how it was found, e.g. "loaded avx512bf16 (prebuilt): <path>", or why none is."""
    library()
    emulated = isa_emulated()
    return build_status(emulated) + (" (AVX-512 and AMX emulated in portable C)" if emulated else "")
