"""Small C kernels for the CPU path, compiled on first use with the machine's C compiler and loaded with ctypes.

torch runs the engine's elementwise chains as one pass over memory per op; where a chain sits between two
matmuls a C loop that keeps each row in registers does the same arithmetic in one pass. The largest is the
Gated DeltaNet's token mixing (`pt_delta_chunked`): conv1d + SiLU, L2 norms, each chunk's decays, UT inverse
and small products (register-blocked FMA outer products) and the recurrence, in one pass per head whose
working set stays in cache. The sources ship with the package (a file per op family: norm_act.c and its AVX-512
twin, conv.c, delta.c, delta_bf16.c, attention.c, attention_bf16.c, features.c, over the shared headers vec.h,
matmul.h, matmul_bf16.h; plain C11 + OpenMP, no torch headers) and are built into one library with
`-O3 -march=native` in the engine's cache directory, keyed by the sources, the compiler binary and this CPU's flags,
so a cache shared between machines never hands one machine another's instructions. Built by GCC, the library links libgomp, which resolves to the
copy torch has already loaded (same soname), so its threads are torch's threads; clang's `-fopenmp` links
libomp instead, a second thread pool beside torch's. `CC` names one compiler executable (no extra words).

Every entry point is declared once, in `abi.h` (`abi.py` binds the library from it and writes the checks each build
compiles), and called through `call`, the one place Python calls into the library: it returns 0 where the kernel
ran, else a decline code (`decline_reason`), and the caller takes its torch path. Every native kernel has a torch
implementation beside it, used when there is no compiler, the build fails, or `PIXELTRIAGE_NATIVE=0` is set;
`available()` says which is in use and `status()` why. The tests compare the two.

The AVX-512 and AMX paths (the bf16 kernels, the vector conv and math) are built where `-march=native` finds those
units. `PIXELTRIAGE_NATIVE_ISA=emulated` (or `emulated_isa()`, for a block of code) builds and loads the same sources
with `isa_emulation.h` in place of the CPU's intrinsics instead: every such path then runs on any CPU, slowly, so
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
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence, TypeVar

from pixeltriage.errors import BackendUnavailableError
from pixeltriage.kernels.native import abi

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# the library's sources, one file per op family (abi.h names the functions of each)
SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
# -fno-trapping-math: nothing here reads the floating-point exception flags, and with them kept GCC does not
# if-convert the clamps and selects of the scalar loops (exp, SiLU), so e.g. the AVX2 build's conv stayed scalar
# (its bench-small delta pass 0.61x with the flag; outputs bit-identical)
# -fvisibility=hidden: abi.h's PT_API functions alone are exported; -Werror=missing-prototypes: every function the
# sources define outside their own file is declared in a header (abi.h for the entry points)
FLAGS = ["-O3", "-march=native", "-std=c11", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
         "-fopenmp-simd", "-fvisibility=hidden", "-Werror=missing-prototypes"]
# every symbol resolved at link time: an entry point abi.h declares and no source defines fails the build
LINK_FLAGS = ["-Wl,-z,defs", "-lm"]
# the emulated build's (isa.h); its 64-byte vectors between inline functions draw GCC's ABI note, which means nothing
EMULATION_FLAGS = ["-DPT_ISA_EMULATION", "-Wno-psabi"]
ISA_SWITCH = "PIXELTRIAGE_NATIVE_ISA"       # "native" (the default) or "emulated"
_state: dict[str, str] = {}        # each library's build status, by its prefix (+ " emulated")
_isa_override: list[bool] = []     # emulated_isa()'s, innermost last: before the environment


def _disabled() -> bool:
    return os.environ.get("PIXELTRIAGE_NATIVE", "1").strip().lower() in ("0", "false", "off", "no")


@functools.cache
def _isa_switch() -> bool:
    """PIXELTRIAGE_NATIVE_ISA, read once per process (like the libraries it picks): True for "emulated"."""
    value = os.environ.get(ISA_SWITCH, "native").strip().lower() or "native"
    if value not in ("native", "emulated"):
        raise ValueError(f"{ISA_SWITCH}={value!r}: expected 'native' (the CPU's own instructions) or 'emulated' "
                         "(AVX-512 and AMX in portable C, for tests)")
    return value == "emulated"


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
    """Inside the block, every kernel library (this one's and `kernels.simd`'s) is the emulated build (on=True) or
    the CPU's own (False), whatever PIXELTRIAGE_NATIVE_ISA says; both stay loaded. Process-wide, not per thread: for
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
    "Features" and "CPU implementer" on aarch64; {} where there is no such file. The one reader of the file for the
    build's key, `kernels.tuning.machine_key` and `bench.timing.cpu_machine`."""
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


def _compile(cc: str, sources: Sequence[Path], out: Path, flags: list[str], generated: str = "") -> None:
    """Build `sources` (and the C text `generated`, compiled beside them with their directory on the include path)
    into the library at `out` (atomically: concurrent builders each rename a complete file into place)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    extra = []
    if generated:
        fd, check = tempfile.mkstemp(prefix=out.name + ".", suffix=".c", dir=out.parent)
        with os.fdopen(fd, "w") as f:
            f.write(generated)
        extra = [check, f"-I{sources[0].parent}"]
    try:
        errors = []
        for openmp in (["-fopenmp"], []):              # without OpenMP the pragmas are ignored: one thread
            cmd = [cc, *flags, *openmp, *map(str, sources), *extra, "-o", tmp, *LINK_FLAGS]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                if not openmp:
                    log.warning("%s built without OpenMP (%s): it runs on one thread", source.name, cc)
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o755 & ~umask)       # mkstemp made it 0600: readable by every user of the cache
                os.replace(tmp, out)
                return
            errors.append(f"$ {' '.join(cmd)}\n{r.stderr.strip()[-2000:]}")
        raise RuntimeError("\n".join(errors))
    finally:
        for path in [tmp, *extra[:1]]:
            if os.path.exists(path):
                os.unlink(path)


def build(sources: Sequence[Path], prefix: str, what: str, instead: str = "the torch implementations",
          emulated: bool = False, generated: str = "") -> ctypes.CDLL | None:
    """Build (once per source, compiler binary, flags and CPU) and load the C library of `sources` (and the C text
    `generated` beside them), named `{prefix}_{key}.so` in the build directory (`emulated_{prefix}_{key}.so` for the
    emulated build, `isa.h`); None when disabled, not on Linux, without a compiler, or when the build fails
    (`build_status(prefix, emulated)` says which; the warning names `instead`, what runs in its place)."""
    state_key = _state_key(prefix, emulated)

    def done(status: str, lib: ctypes.CDLL | None = None) -> ctypes.CDLL | None:
        _state[state_key] = status
        return lib

    flags = FLAGS + EMULATION_FLAGS if emulated else FLAGS
    if emulated:
        prefix, what = f"emulated_{prefix}", f"{what} (AVX-512 and AMX emulated)"   # not in the native build's glob

    if _disabled():
        return done("disabled by PIXELTRIAGE_NATIVE=0")
    if platform.system() != "Linux":
        return done(f"not built on {platform.system()} (Linux only)")
    cc = _compiler()
    if cc is None:
        log.warning("%s: no C compiler found (set CC); using %s", what, instead)
        return done("no C compiler found (set CC)")
    try:                              # the compiler binary itself (cheaper than running `cc --version` per process)
        real = os.path.realpath(cc)
        st = os.stat(real)
        compiler = f"{real}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        compiler = cc
    # the headers beside the sources (`#include "..."`) are part of what is built: a changed header is a new build
    headers = [h.name.encode() + b"\0" + h.read_bytes() for h in sorted(sources[0].parent.glob("*.h"))]
    key = hashlib.sha256(b"\0".join([*(s.read_bytes() for s in sources), *headers, generated.encode(),
                                     compiler.encode(), " ".join(flags).encode(), _cpu_flags().encode(),
                                     platform.machine().encode()])).hexdigest()[:20]
    path = _build_dir() / f"{prefix}_{key}.so"
    try:
        if not path.is_file():
            log.info("building %s with %s -> %s", what, cc, path)
            _compile(cc, sources, path, flags, generated)
            _prune(path, prefix)
        import torch  # noqa: F401  (torch's OpenMP runtime is loaded first, so the library binds to it)

        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        status = f"build or load failed: {str(e).strip()[:4000]}"
        log.warning("%s unavailable, using %s: %s", what, instead, status)
        return done(status)
    return done(f"loaded {path}", lib)


def _state_key(prefix: str, emulated: bool) -> str:
    return prefix + (" emulated" if emulated else "")


def build_status(prefix: str = "pixeltriage_cpu", emulated: bool | None = None) -> str:
    """What `build` did with library `prefix` (its emulated build if emulated; None: the one `isa_emulated()` says)
    in this process ("not loaded" before it was asked)."""
    return _state.get(_state_key(prefix, isa_emulated() if emulated is None else emulated), "not loaded")


@per_isa
def library(emulated: bool) -> ctypes.CDLL | None:
    """The loaded kernel library, bound from abi.h, or None (then callers take their torch path); built once per
    machine (and once more for the emulated build, `isa_emulated()`)."""
    lib = build(SOURCES, "pixeltriage_cpu", "native CPU kernels", emulated=emulated,
                generated=abi.load().check_source())
    return None if lib is None else abi.load().bind(lib)


KEEP_BUILDS = 8     # builds kept per cache directory (other sources, compilers or CPUs sharing it), newest first


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


def call(kernel: str, *args) -> int:
    """Run C entry point `kernel` (abi.h) with `args`, and torch's thread count where its last parameter is nthreads:
    0 where it ran, else its decline code (`decline_reason`; a kernel declines before it writes anything, and the
    caller takes its torch path). The one place Python calls into the library. BackendUnavailableError where no
    library is loaded (callers ask `handles` or `available` first)."""
    import torch

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
    library()
    emulated = isa_emulated()
    return build_status(emulated=emulated) + (" (AVX-512 and AMX emulated in portable C)" if emulated else "")
