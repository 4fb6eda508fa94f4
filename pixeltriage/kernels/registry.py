"""Which kernel runs each op, through one entry point per op that also records what ran.

An op (`op(name, key)`) holds its kernels, best first. Calling it runs the first kernel, in priority order, whose
devices and dtypes fit the call (`key` names the call's device and the dtype that decides), whose `available()`
holds (the library or package is there; the switches of `pixeltriage.settings` and the choices measured on this
machine, `kernels.tuning`, say it may run) and whose `accepts(*args)` returns None; `accepts` returns instead the
reason the kernel declines the call (the shape, dtype and layout checks it needs), and a kernel whose function
raises `Declined` declines too (a C entry point's non-zero return, `c_call`): the next kernel runs. A kernel is
its function, its `accepts` and one `register` call beside them; no op looks at which kernel was chosen.

Every call and every decline is counted, per (op, kernel) and per reason: for the process (`counts`) and for the
`Record` active in the caller's context (`recording`: a Scorer's, for its forwards). The first decline of each
(op, kernel, reason) logs one WARNING. While torch.profiler records, each call is a range named "op: kernel".
`choose` and `choices` name the kernel a call would start with (the load's log, /info, gpu_check).

The test switch: with PIXELTRIAGE_EMULATE_CUDA=1 and TRITON_INTERPRET=1 (`pixeltriage.settings`), CPU tensors get
the CUDA kernels (the Triton and flash-linear-attention ones run in Triton's interpreter), so the CUDA forward runs
in CI without a GPU. Under emulation float32 also takes the kernels a CUDA device runs only for bf16 and fp16, so
that they are checked against the CPU forward at float32's tolerance; Triton's interpreter multiplies bf16 operands
as raw integers, so a bf16 run under emulation needs `pixeltriage.bench.emulation` (tensor cores' `tl.dot`).
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from pixeltriage import settings
from pixeltriage.errors import BackendUnavailableError

log = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda")
# The packages whose import registers the ops' kernels; `choose`, `choices` and `ops` import them first.
OP_MODULES = ("pixeltriage.kernels.gated_delta", "pixeltriage.kernels.conv", "pixeltriage.kernels.norm",
              "pixeltriage.kernels.rotary", "pixeltriage.kernels.activation", "pixeltriage.kernels.linear",
              "pixeltriage.kernels.attention", "pixeltriage.kernels.head")


class Declined(BackendUnavailableError):
    """A kernel declined a call: raised by its function where it finds out only while running (a C entry point's
    non-zero return), and by `run` to a caller that asked for that one kernel. `reason` says why, in words that do
    not depend on the call's sizes (they label the decline counters)."""

    def __init__(self, reason: str, kernel: "Kernel | None" = None):
        self.reason, self.kernel = reason, kernel
        super().__init__(reason if kernel is None else f"{kernel.op}: {kernel.name} declined: {reason}")


def _always() -> bool:
    return True


@dataclass(frozen=True, eq=False)
class Kernel:
    """One implementation of an op: fn(*args) -> the op's result; accepts(*args) -> None, or why it declines them.
    available: whether calls may take it here. slow: a fallback that CUDA refuses unless allow_slow (`check_fast`).
    entry: the C entry point it calls, if any (named by the tests that claim it)."""
    op: str
    name: str
    fn: Callable
    accepts: Callable[..., str | None] | None = None
    available: Callable[[], bool] = _always
    devices: tuple[str, ...] = ("cpu",)
    dtypes: tuple[torch.dtype, ...] | None = None
    priority: int = 0
    slow: bool = False
    package: str | None = None
    entry: str | None = None
    label: str = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "label", f"{self.op}: {self.name}")

    def fits(self, kdevice: str, dtype: torch.dtype, emulated: bool) -> bool:
        return kdevice in self.devices and (self.dtypes is None or dtype in self.dtypes
                                            or (emulated and dtype == torch.float32))


class Op:
    """One op: its kernels best first, and its entry point (calling the Op runs the call, see the module).
    key(*args, **kwargs) -> (the call's torch.device, the dtype its kernels are chosen by)."""

    def __init__(self, name: str, key: Callable[..., tuple[torch.device, torch.dtype]]):
        self.name, self.key = name, key
        self.kernels: list[Kernel] = []
        self._fitting: dict[tuple[str, torch.dtype, bool], tuple[Kernel, ...]] = {}

    def register(self, name: str, fn: Callable, *, accepts: Callable[..., str | None] | None = None,
                 devices: Sequence[str] = ("cpu",), dtypes: Sequence[torch.dtype] | None = None,
                 available: Callable[[], bool] = _always, priority: int = 0, slow: bool = False,
                 package: str | None = None, entry: str | None = None) -> Kernel:
        """Register `fn` as kernel `name` for tensors on `devices` of `dtypes` (None: any) while `available()`.

        Higher priority is tried first; between equal priorities, the earlier registration. package: what to
        install when the kernel is unavailable (named by `check_fast` when a slow fallback is chosen in its place).
        Registering one name twice for overlapping devices and dtypes is an error (a module imported twice under two
        names would double up)."""
        devices = tuple(devices)
        if not devices or any(d not in DEVICES for d in devices):
            raise ValueError(f"kernel {self.name}/{name}: devices must be some of {DEVICES}, got {devices}")
        dtypes = None if dtypes is None else tuple(dtypes)
        if any(k.name == name and set(k.devices) & set(devices)
               and (k.dtypes is None or dtypes is None or set(k.dtypes) & set(dtypes)) for k in self.kernels):
            raise ValueError(f"kernel {self.name}/{name} is already registered for {devices} and {dtypes}")
        kernel = Kernel(self.name, name, fn, accepts, available, devices, dtypes, priority, slow, package, entry)
        self.kernels.append(kernel)
        self.kernels.sort(key=lambda k: -k.priority)          # stable: equal priorities keep registration order
        self._fitting.clear()
        return kernel

    def fitting(self, device: torch.device | str, dtype: torch.dtype) -> tuple[Kernel, ...]:
        """The kernels whose devices and dtypes fit, best first (availability is asked at each call)."""
        kind = _kind(device)
        emulated = kind == "cpu" and emulating_cuda()
        found = self._fitting.get((kind, dtype, emulated))
        if found is None:
            kdevice = "cuda" if emulated else kind
            found = self._fitting[kind, dtype, emulated] = tuple(
                k for k in self.kernels if k.fits(kdevice, dtype, emulated))
        return found

    def choose(self, device: torch.device | str, dtype: torch.dtype) -> Kernel:
        """The kernel a call on `device` deciding by `dtype` starts with: the first fitting one available.
        BackendUnavailableError when none is."""
        for kernel in self.fitting(device, dtype):
            if kernel.available():
                return kernel
        raise BackendUnavailableError(f"no kernel of op {self.name!r} runs {dtype} on {kernel_device(device)}"
                                      f"{' (emulated on the CPU)' if _emulated(device) else ''}")

    def __call__(self, *args, **kwargs):
        """Run the op: the first fitting, available kernel that accepts the call and does not decline it."""
        device, dtype = self.key(*args, **kwargs)
        declines = []
        for kernel in self.fitting(device, dtype):
            if not kernel.available():
                continue
            out = _attempt(kernel, args, kwargs)
            if not isinstance(out, Declined):
                return out
            declines.append(f"{kernel.name}: {out.reason}")
        raise BackendUnavailableError(f"no kernel of op {self.name!r} runs {dtype} on {kernel_device(device)}"
                                      f"{' (emulated on the CPU)' if _emulated(device) else ''}"
                                      f"{'; declined: ' + '; '.join(declines) if declines else ''}")


_OPS: dict[str, Op] = {}


def op(name: str, key: Callable[..., tuple[torch.device, torch.dtype]]) -> Op:
    """A new op named `name` (an error if there is one: each op is made once, by its module)."""
    if name in _OPS:
        raise ValueError(f"op {name!r} exists already")
    made = _OPS[name] = Op(name, key)
    return made


def run(kernel: Kernel, *args, **kwargs):
    """Run exactly `kernel` (its `accepts`, then its function), counted as a call of it: for a caller that wants one
    implementation (a measurement, a test, a choice the user made). Declined where it declines the call."""
    out = _attempt(kernel, args, kwargs)
    if isinstance(out, Declined):
        raise out
    return out


def c_call(name: str, *args) -> None:
    """Call C entry point `name` (`native.call`, the one call site of the C kernels); a non-zero return raises
    Declined with `native.decline_reason`'s words (abi.h's reason for the code), so the op's next kernel runs."""
    from pixeltriage.kernels import native

    code = native.call(name, *args)
    if code:
        raise Declined(f"{name}: {native.decline_reason(name, code)}")


# ---- what ran ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelCounts:
    """Calls per (op, kernel name) and declines per (op, kernel name, reason), as counted up to a moment."""
    calls: dict[tuple[str, str], int]
    declines: dict[tuple[str, str, str], int]

    def ran(self, op: str, kernel: str) -> int:
        return self.calls.get((op, kernel), 0)

    def declined(self, op: str, kernel: str) -> dict[str, int]:
        """reason -> how many calls `kernel` of `op` declined for it."""
        return {r: n for (o, k, r), n in self.declines.items() if (o, k) == (op, kernel)}

    def since(self, earlier: "KernelCounts") -> "KernelCounts":
        """What was counted after `earlier` (a snapshot of the same record)."""
        return KernelCounts({k: n - earlier.calls.get(k, 0) for k, n in self.calls.items()
                             if n > earlier.calls.get(k, 0)},
                            {k: n - earlier.declines.get(k, 0) for k, n in self.declines.items()
                             if n > earlier.declines.get(k, 0)})

    def to_dict(self) -> dict:
        """{"calls": {op: {kernel: n}}, "declines": {op: {kernel: {reason: n}}}}, sorted (for JSON)."""
        calls: dict = {}
        for (o, k), n in sorted(self.calls.items()):
            calls.setdefault(o, {})[k] = n
        declines: dict = {}
        for (o, k, r), n in sorted(self.declines.items()):
            declines.setdefault(o, {}).setdefault(k, {})[r] = n
        return {"calls": calls, "declines": declines}


class Record:
    """Counts of calls and declines (see the module); `snapshot()` reads them."""

    def __init__(self) -> None:
        self._calls: dict[Kernel, int] = {}
        self._declines: dict[tuple[Kernel, str], int] = {}

    def snapshot(self) -> KernelCounts:
        calls: dict[tuple[str, str], int] = {}
        declines: dict[tuple[str, str, str], int] = {}
        with _lock:
            for kernel, n in self._calls.items():
                calls[kernel.op, kernel.name] = calls.get((kernel.op, kernel.name), 0) + n
            for (kernel, reason), n in self._declines.items():
                key = (kernel.op, kernel.name, reason)
                declines[key] = declines.get(key, 0) + n
        return KernelCounts(calls, declines)


_lock = threading.Lock()
_PROCESS = Record()
_ACTIVE: contextvars.ContextVar[tuple[Record, ...]] = contextvars.ContextVar("pixeltriage_kernel_records", default=())
_warned: set[tuple[Kernel, str]] = set()


def counts() -> KernelCounts:
    """Every kernel call and decline of this process so far."""
    return _PROCESS.snapshot()


@contextlib.contextmanager
def recording(record: Record | None = None) -> Iterator[Record]:
    """Inside the block (in this context: this thread, this task), calls and declines are counted in `record` (a
    new one when None) as well as the process's and those of the blocks around it (a record active already is
    not counted twice)."""
    record = Record() if record is None else record
    active = _ACTIVE.get()
    if record in active:
        yield record
        return
    token = _ACTIVE.set(active + (record,))
    try:
        yield record
    finally:
        _ACTIVE.reset(token)


def _attempt(kernel: Kernel, args: tuple, kwargs: dict):
    """The kernel's result for the call, or, where it declines it (`accepts`, or `Declined` from its function), a
    Declined saying why (counted as a decline)."""
    reason = None if kernel.accepts is None else kernel.accepts(*args, **kwargs)
    if reason is None:
        try:
            return _call(kernel, args, kwargs)
        except Declined as e:
            reason = e.reason
    _declined(kernel, reason)
    return Declined(reason, kernel)


def _call(kernel: Kernel, args: tuple, kwargs: dict):
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(kernel.label):
            out = kernel.fn(*args, **kwargs)
    else:
        out = kernel.fn(*args, **kwargs)
    records = _ACTIVE.get()
    with _lock:
        _PROCESS._calls[kernel] = _PROCESS._calls.get(kernel, 0) + 1
        for record in records:
            record._calls[kernel] = record._calls.get(kernel, 0) + 1
    return out


def _declined(kernel: Kernel, reason: str) -> None:
    key = (kernel, reason)
    records = _ACTIVE.get()
    with _lock:
        _PROCESS._declines[key] = _PROCESS._declines.get(key, 0) + 1
        for record in records:
            record._declines[key] = record._declines.get(key, 0) + 1
        first = key not in _warned
        _warned.add(key)
    if first:
        log.warning("%s: kernel %r declined a call (%s); the next kernel runs it (logged once per reason)",
                    kernel.op, kernel.name, reason)


# ---- choices ----------------------------------------------------------------------------------------------------

def emulating_cuda() -> bool:
    """Whether the test switch is on (PIXELTRIAGE_EMULATE_CUDA=1 with TRITON_INTERPRET=1, `pixeltriage.settings`,
    whose parse is a ValueError naming both variables when the switch is set without the interpreter)."""
    return settings.current().emulate_cuda


def kernel_device(device: torch.device | str) -> str:
    """The device whose kernels run tensors on `device`: "cuda" for CUDA, and for the CPU under the test switch
    (`emulating_cuda`); "cpu" otherwise."""
    kind = _kind(device)
    return "cuda" if kind == "cuda" or (kind == "cpu" and emulating_cuda()) else kind


def _kind(device: torch.device | str) -> str:
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def _emulated(device: torch.device | str) -> bool:
    return _kind(device) == "cpu" and emulating_cuda()


def _load_ops() -> None:
    for module in OP_MODULES:
        importlib.import_module(module)


def ops() -> dict[str, Op]:
    """Every registered op, by name."""
    _load_ops()
    return dict(sorted(_OPS.items()))


def get(name: str) -> Op:
    """The op named `name`; KeyError naming the known ones."""
    _load_ops()
    if name not in _OPS:
        raise KeyError(f"no kernels registered for op {name!r}; known: {sorted(_OPS)}")
    return _OPS[name]


def choose(op_name: str, device: torch.device | str, dtype: torch.dtype) -> Kernel:
    """`get(op_name).choose(device, dtype)`: the kernel a call starts with."""
    return get(op_name).choose(device, dtype)


def choices(device: torch.device | str, dtype: torch.dtype) -> dict[str, str]:
    """op -> the name of the kernel `choose` takes for it, for every registered op (for /info, gpu_check, logs)."""
    names = {}
    for name, an_op in ops().items():
        try:
            names[name] = an_op.choose(device, dtype).name
        except BackendUnavailableError:
            names[name] = "none available"
    return names


def check_fast(device: torch.device | str, dtype: torch.dtype, allow_slow: bool) -> None:
    """BackendUnavailableError naming the missing packages when, on CUDA, an op's choice is a slow fallback (a
    faster kernel for this dtype is registered but unavailable) and allow_slow is False."""
    if allow_slow:
        return
    slow = {}
    for name, an_op in ops().items():
        try:
            kernel = an_op.choose(device, dtype)
        except BackendUnavailableError:
            continue
        if kernel.slow:
            slow[name] = (kernel, sorted({k.package for k in an_op.fitting(device, dtype)
                                          if k.package and not k.slow and not k.available()}))
    if slow:
        missing = sorted({p for _, packages in slow.values() for p in packages}) or ["its fast kernels"]
        detail = ", ".join(f"{name}: {kernel.name}" for name, (kernel, _) in slow.items())
        raise BackendUnavailableError(f"CUDA needs {' and '.join(missing)} for its fast kernels (pip install "
                                      f"'pixeltriage[gpu]'); without them it would run {detail}; pass "
                                      f"allow_slow=True to run these fallbacks")
