"""Which kernel runs each op: one small registry per op, decided from device, dtype, availability and a test switch.

Each op's package registers its kernels when it is imported (`register`); `choose` hands back the highest-priority
kernel whose devices and dtypes fit and whose `available()` holds, and names it, so that /info, gpu_check and the
profiler report what actually runs (`choices`). Adding an op's fast path is its kernel file and one registration.

The test switch: with PIXELTRIAGE_EMULATE_CUDA=1 and TRITON_INTERPRET=1 (`pixeltriage.settings`), CPU tensors get the CUDA kernels (the
Triton and flash-linear-attention ones run in Triton's interpreter), so the CUDA forward runs in CI without a GPU.
The interpreter cannot run bf16 dots, so under emulation float32 stands in for the dtypes a CUDA kernel was
registered for. The switch without the interpreter is an error, never silently ignored.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from pixeltriage import settings
from pixeltriage.errors import BackendUnavailableError

EMULATE_CUDA = "PIXELTRIAGE_EMULATE_CUDA"
TRITON_INTERPRET = "TRITON_INTERPRET"
DEVICES = ("cpu", "cuda")
# The packages whose import registers the ops' kernels; `choose` and `choices` import them first.
OP_MODULES = ("pixeltriage.kernels.gated_delta", "pixeltriage.kernels.conv", "pixeltriage.kernels.norm",
              "pixeltriage.kernels.rotary", "pixeltriage.kernels.activation", "pixeltriage.kernels.linear",
              "pixeltriage.kernels.attention", "pixeltriage.kernels.head")


@dataclass(frozen=True)
class Kernel:
    """One implementation of an op. slow: a fallback that CUDA refuses unless allow_slow (`check_fast`)."""
    op: str
    name: str
    fn: Callable
    slow: bool = False


@dataclass(frozen=True)
class _Entry:
    kernel: Kernel
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] | None
    available: Callable[[], bool]
    priority: int
    package: str | None


_ENTRIES: dict[str, list[_Entry]] = {}


def register(op: str, name: str, fn: Callable, *, devices: Sequence[str] = ("cpu",),
             dtypes: Sequence[torch.dtype] | None = None, available: Callable[[], bool] = lambda: True,
             priority: int = 0, slow: bool = False, package: str | None = None) -> Kernel:
    """Register `fn` as kernel `name` of `op` for tensors on `devices` of `dtypes` (None: any) while `available()`.

    Higher priority wins; between equal priorities, the earlier registration. package: what to install when the
    kernel is unavailable (named by `check_fast` when a slow fallback is chosen in its place). Registering one name
    twice for overlapping devices and dtypes is an error (a module imported twice under two names would double
    up). Returns the Kernel, which the op's own functions compare `choose`'s answer with."""
    devices = tuple(devices)
    if not devices or any(d not in DEVICES for d in devices):
        raise ValueError(f"kernel {op}/{name}: devices must be some of {DEVICES}, got {devices}")
    entries = _ENTRIES.setdefault(op, [])
    dtypes = None if dtypes is None else tuple(dtypes)
    if any(e.kernel.name == name and set(e.devices) & set(devices)
           and (e.dtypes is None or dtypes is None or set(e.dtypes) & set(dtypes)) for e in entries):
        raise ValueError(f"kernel {op}/{name} is already registered for {devices} and {dtypes}")
    kernel = Kernel(op, name, fn, slow)
    entries.append(_Entry(kernel, devices, dtypes, available, priority, package))
    entries.sort(key=lambda e: -e.priority)          # stable: equal priorities keep registration order
    _candidates.cache_clear()
    return kernel


def emulating_cuda() -> bool:
    """Whether the test switch is on (PIXELTRIAGE_EMULATE_CUDA=1 with TRITON_INTERPRET=1, `pixeltriage.settings`,
    whose parse is a ValueError naming both variables when the switch is set without the interpreter)."""
    return settings.current().emulate_cuda


def kernel_device(device: torch.device | str) -> str:
    """The device whose kernels run tensors on `device`: "cuda" for CUDA, and for the CPU under the test switch
    (`emulating_cuda`); "cpu" otherwise."""
    kind = _kind(device)
    if kind == "cuda" or (kind == "cpu" and emulating_cuda()):
        return "cuda"
    return kind


def _kind(device: torch.device | str) -> str:
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def _load_ops() -> None:
    for module in OP_MODULES:
        importlib.import_module(module)


@functools.lru_cache(maxsize=None)
def _candidates(op: str, kdevice: str, dtype: torch.dtype, emulated: bool) -> tuple[_Entry, ...]:
    """The op's entries for this device and dtype, best first (availability is asked at each choice)."""
    return tuple(e for e in _ENTRIES.get(op, ()) if kdevice in e.devices
                 and (e.dtypes is None or dtype in e.dtypes or (emulated and dtype == torch.float32)))


def choose(op: str, device: torch.device | str, dtype: torch.dtype) -> Kernel:
    """The kernel that runs `op` for tensors of `dtype` on `device`: the highest-priority registration whose devices
    (`kernel_device(device)`) and dtypes fit and whose `available()` holds. BackendUnavailableError when none does;
    KeyError for an op nobody registered."""
    if op not in _ENTRIES:
        _load_ops()
        if op not in _ENTRIES:
            raise KeyError(f"no kernels registered for op {op!r}; known: {sorted(_ENTRIES)}")
    kdevice = kernel_device(device)
    emulated = kdevice == "cuda" and _kind(device) == "cpu"
    for entry in _candidates(op, kdevice, dtype, emulated):
        if entry.available():
            return entry.kernel
    raise BackendUnavailableError(f"no kernel of op {op!r} runs {dtype} on {kdevice}"
                                  f"{' (emulated on the CPU)' if emulated else ''}")


def choices(device: torch.device | str, dtype: torch.dtype) -> dict[str, str]:
    """op -> the name of the kernel `choose` takes for it, for every registered op (for /info, gpu_check, logs)."""
    _load_ops()
    names = {}
    for op in sorted(_ENTRIES):
        try:
            names[op] = choose(op, device, dtype).name
        except BackendUnavailableError:
            names[op] = "none available"
    return names


def check_fast(device: torch.device | str, dtype: torch.dtype, allow_slow: bool) -> None:
    """BackendUnavailableError naming the missing packages when, on CUDA, an op's choice is a slow fallback (a
    faster kernel for this dtype is registered but unavailable) and allow_slow is False."""
    if allow_slow:
        return
    _load_ops()
    slow = {}
    for op in sorted(_ENTRIES):
        try:
            kernel = choose(op, device, dtype)
        except BackendUnavailableError:
            continue
        if kernel.slow:
            kdevice = kernel_device(device)
            emulated = kdevice == "cuda" and _kind(device) == "cpu"
            slow[op] = sorted({e.package for e in _candidates(op, kdevice, dtype, emulated)
                               if e.package and not e.kernel.slow and not e.available()})
    if slow:
        missing = sorted({p for packages in slow.values() for p in packages}) or ["its fast kernels"]
        detail = ", ".join(f"{op}: {choose(op, device, dtype).name}" for op in slow)
        raise BackendUnavailableError(f"CUDA needs {' and '.join(missing)} for its fast kernels (pip install "
                                      f"'pixeltriage[gpu]'); without them it would run {detail}; pass "
                                      f"allow_slow=True to run these fallbacks")
