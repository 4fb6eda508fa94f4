"""The CUDA path on a CPU: its Triton and flash-linear-attention kernels run in Triton's interpreter, with `tl.dot`
computed as tensor cores compute it, and every launch recorded (kernel, specialization, constexprs, the autotune
configs it would try) for `bench compile`.

Written against triton 3.9.0 and flash-linear-attention 0.6.0 (the versions the `test` extra pins). While
`cuda_emulation()` is active:

- Autotune benchmarks every config through a GPU driver (`RuntimeError: 0 active drivers`): `Autotuner.prune_configs`
  is cut to its first surviving config, and a single config is run without benchmarking (Autotuner.run's own
  single-config path). Which config runs does not change the result, only the launch geometry.
- A `for x in range(...)` loop variable arrives in the kernel as a Python int, where compiled Triton gives a tensor,
  so `i_t.to(tl.int64)` (fla/ops/common/chunk_delta_h.py) fails with `'int' object has no attribute 'to'`: the
  interpreter's AST rewrite gets a `visit_For` that rebinds the variable as an interpreter tensor at the top of the
  body, and the cache of rewritten kernels is cleared on entry and on exit, so kernels rewritten inside (and only
  those) carry it.
- `tl.dot` on bf16 or fp16 operands computes as tensor cores do: the operands as the kernel rounded them (their
  dtype), every product and sum in float32, the result in the accumulator's dtype (float32, or fp16 where a kernel
  asks for an fp16 result: then rounded once at the end, where fp16 tensor cores may round partial sums). The
  interpreter's own dot multiplies bf16's raw bits as integers (triton issue 11584). float32 dots stay IEEE float32
  here, where a GPU's default precision is TF32: the CUDA forward's float32 path runs none (it takes the torch
  chunked rule; fla's float32 kernels run here only as the registry's stand-in).
- PIXELTRIAGE_EMULATE_CUDA=1, so `kernels.registry` gives CPU tensors the CUDA kernels.

`record_launches()` (inside `cuda_emulation()`) also records each launch as the compiler for a named target would
see it, and for an autotuned kernel every config its autotuner would time (after its own pruning), each as one more
launch. `emulate_target(...)` makes flash-linear-attention see a GPU of that target when it is imported afterwards
(its autotune lists and block sizes depend on the device): only in a process of its own (`bench compile` starts one).

Importing this module checks the pinned versions and the internals the patches rely on, and raises
InterpreterHarnessError naming what changed: a mismatch fails loudly, it is never skipped.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import inspect
import os
import types
from dataclasses import dataclass, field

from pixeltriage import settings

TRITON_VERSION = "3.9.0"
FLA_VERSION = "0.6.0"
EMULATE_CUDA = "PIXELTRIAGE_EMULATE_CUDA"


class InterpreterHarnessError(RuntimeError):
    """The installed triton / flash-linear-attention are not what the interpreter workarounds were written for."""


def check_versions() -> None:
    found = {}
    for package in ("triton", "flash-linear-attention", "fla-core"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    wanted = {"triton": TRITON_VERSION, "flash-linear-attention": FLA_VERSION, "fla-core": FLA_VERSION}
    wrong = [f"{p} {found[p] or 'not installed'} (expected {v})" for p, v in wanted.items() if found[p] != v]
    if wrong:
        raise InterpreterHarnessError(
            f"pixeltriage/bench/emulation.py was written against triton {TRITON_VERSION} and flash-linear-attention "
            f"{FLA_VERSION}; found {', '.join(wrong)}. Re-check its workarounds against the new versions, then "
            f"update the pins here and in pyproject.toml's test extra")


def check_internals() -> None:
    """The names and behaviours the patches rely on, each failure naming the one that changed."""
    from triton.runtime import autotuner, interpreter

    problems = []
    if not hasattr(interpreter, "ASTTransformer") or not issubclass(interpreter.ASTTransformer, ast.NodeTransformer):
        problems.append("triton.runtime.interpreter.ASTTransformer (an ast.NodeTransformer) is gone")
    elif "visit_For" in vars(interpreter.ASTTransformer):
        problems.append("triton's interpreter now rewrites for loops itself (ASTTransformer.visit_For): the range "
                        "workaround may be obsolete or conflict")
    if not isinstance(getattr(getattr(interpreter, "InterpretedFunction", None), "rewritten_fn", None), dict):
        problems.append("triton.runtime.interpreter.InterpretedFunction.rewritten_fn (the rewrite cache) is gone")
    semantic = getattr(interpreter, "interpreter_semantic", None)
    if semantic is None or not callable(getattr(semantic, "to_tensor", None)):
        problems.append("triton.runtime.interpreter.interpreter_semantic.to_tensor is gone")
    prune = getattr(autotuner.Autotuner, "prune_configs", None)
    if prune is None or list(inspect.signature(prune).parameters) != ["self", "kwargs"]:
        problems.append("triton.runtime.autotuner.Autotuner.prune_configs(self, kwargs) changed")
    if "len(pruned_configs) == 1" not in inspect.getsource(autotuner.Autotuner.run):
        problems.append("triton.runtime.autotuner.Autotuner.run no longer runs a single pruned config unbenchmarked")
    dot = getattr(getattr(interpreter, "InterpreterBuilder", None), "create_dot", None)
    if dot is None or list(inspect.signature(dot).parameters) != ["self", "a", "b", "d", "input_precision",
                                                                  "max_num_imprecise_acc"]:
        problems.append("triton.runtime.interpreter.InterpreterBuilder.create_dot(self, a, b, d, input_precision, "
                        "max_num_imprecise_acc) changed")
    run = getattr(getattr(interpreter, "InterpretedFunction", None), "run", None)
    if run is None or list(inspect.signature(run).parameters) != ["self", "args", "grid", "warmup", "kwargs"]:
        problems.append("triton.runtime.interpreter.InterpretedFunction.run(self, *args, grid, warmup, **kwargs) "
                        "changed")
    from fla.ops.utils.cache import CachedAutotuner

    if not issubclass(CachedAutotuner, autotuner.Autotuner):
        problems.append("fla.ops.utils.cache.CachedAutotuner no longer extends triton's Autotuner")
    if problems:
        raise InterpreterHarnessError("pixeltriage/bench/emulation.py: triton/fla internals changed: "
                                      + "; ".join(problems))


def interpreting() -> bool:
    """Whether Triton's kernels run in the interpreter in this process (TRITON_INTERPRET=1 was set before triton was
    first imported: tests/conftest.py sets it on machines without a GPU)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def _visit_for(self, node: ast.For) -> ast.For:
    node = self.generic_visit(node)
    call = node.iter
    is_range = isinstance(call, ast.Call) and (
        (isinstance(call.func, ast.Name) and call.func.id == "range")
        or (isinstance(call.func, ast.Attribute) and call.func.attr == "range"))     # tl.range
    if is_range and isinstance(node.target, ast.Name):
        name = node.target.id
        to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                  ctx=ast.Load())
        rebind = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                            value=ast.Call(func=to_tensor, args=[ast.Name(id=name, ctx=ast.Load()),
                                                                 ast.Constant(value=False)], keywords=[]))
        node.body.insert(0, ast.copy_location(rebind, node))
    return node


def _float32_operand(handle):
    """An interpreter tensor's values as float32: bf16 (kept as its raw 16 bits) widened exactly, fp16 cast."""
    import numpy as np
    import triton.language as tl

    if handle.dtype.scalar == tl.bfloat16:
        return (handle.data.astype(np.uint32) << 16).view(np.float32)
    return handle.data.astype(np.float32)


def tensor_core_dot(original):
    """InterpreterBuilder.create_dot, bf16 and fp16 operands computed as tensor cores do (module docstring)."""
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        low = (tl.bfloat16, tl.float16)
        if a.dtype.scalar not in low and b.dtype.scalar not in low:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        if a.dtype.scalar != b.dtype.scalar:
            raise TypeError(f"tl.dot of {a.dtype.scalar} and {b.dtype.scalar}: tensor cores take one dtype")
        acc = d.dtype.scalar
        if acc not in (tl.float32, tl.float16):
            raise TypeError(f"tl.dot of {a.dtype.scalar} into {acc}: tensor cores accumulate in float32 or fp16")
        out = np.matmul(_float32_operand(a), _float32_operand(b)) + d.data.astype(np.float32)
        return TensorHandle(out.astype(np.float32 if acc == tl.float32 else np.float16), acc)

    create_dot.original = original
    return create_dot


@dataclass
class Launch:
    """One kernel launch as the compiler sees it: the kernel (module, name), its parameters' types and attributes
    (`specialization`, what Triton's binder makes of the arguments: '*bf16' and 'D' for a 16-byte aligned bf16
    pointer, 'i32' and 'D' for an int divisible by 16, ('constexpr', value)), the compile options (num_warps,
    num_stages, ...), the grid, and for an autotuned launch its config's index among the `configs` the autotuner
    would time and which one ran here (`ran`)."""
    module: str
    name: str
    params: list[str]
    specialization: list[tuple]
    options: dict
    grid: tuple
    autotuned: bool = False
    config: int = 0
    configs: int = 1
    ran: bool = True
    origin: str = ""        # the innermost frame outside triton and fla: which call of the forward launched it

    def key(self) -> tuple:
        """What makes one compiled binary: the kernel, its specialization and options."""
        return (self.module, self.name, repr(self.specialization), repr(sorted(self.options.items())))


@dataclass
class _Recording:
    launches: list[Launch] = field(default_factory=list)
    target: object = None          # triton GPUTarget the specialization is made for
    binders: dict = field(default_factory=dict)
    autotune: list = field(default_factory=list)     # stack: (index, count) of the config being launched
    execute: bool = True           # run the launches the forward makes (False: record them only)
    dry: bool = False              # inside an autotuner's other configs: recorded only


_RECORDING: _Recording | None = None
_RUN_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "launch_cooperative_grid")


def _origin() -> str:
    import traceback

    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        if "/pixeltriage/" in path and not path.endswith("bench/emulation.py"):
            return f"{os.path.basename(path)}:{frame.lineno} in {frame.name}"
    return "?"


def _binder(recording: _Recording, fn):
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    found = recording.binders.get(fn.fn)
    if found is None:
        jit = JITFunction(fn.fn, **fn.kwargs)
        found = recording.binders[fn.fn] = (jit, create_function_from_signature(
            jit.signature, jit.params, make_backend(recording.target)))
    return found


def _json_value(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    return str(value)


def _record(recording: _Recording, fn, args, grid, kwargs, ran: bool) -> None:
    jit, binder = _binder(recording, fn)
    options = {k: kwargs[k] for k in _RUN_OPTIONS if k in kwargs}
    call_kwargs = {k: v for k, v in kwargs.items() if k not in _RUN_OPTIONS}
    bound, specialization, _ = binder(*args, **call_kwargs)
    spec = [(kind, _json_value(value)) for kind, value in specialization]
    if callable(grid):
        grid = grid(bound)
    grid = tuple(int(g) for g in grid)
    index, count = recording.autotune[-1] if recording.autotune else (0, 1)
    recording.launches.append(Launch(fn.fn.__module__, fn.fn.__name__, [p.name for p in jit.params], spec, options,
                                     grid, bool(recording.autotune), index, count, ran, _origin()))


def _recording_run(original):
    def run(self, *args, grid, warmup, **kwargs):
        recording = _RECORDING
        if recording is not None and not warmup:
            _record(recording, self, args, grid, kwargs, ran=not recording.dry)
            if recording.dry or not recording.execute:
                return None
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)
    run.original = original
    return run


def _first_config(original):
    def prune_configs(self, kwargs):
        return original(self, kwargs)[:1]
    prune_configs.original = original
    return prune_configs


def _recording_autotune(original):
    """Autotuner.run that, while recording, launches every config the autotuner would time (dry: recorded, not run),
    then runs as before (the first config, `_first_config`)."""
    def run(self, *args, **kwargs):
        recording = _RECORDING
        if recording is None:
            return original(self, *args, **kwargs)
        self.nargs = dict(zip(self.arg_names, args))
        prune = type(self).prune_configs
        configs = getattr(prune, "original", prune)(self, kwargs) if len(self.configs) > 1 else self.configs
        recording.dry = True
        try:
            for i, config in enumerate(configs):
                if i == 0:
                    continue
                recording.autotune.append((i, len(configs)))
                try:
                    self.fn.run(*args, **kwargs, **config.all_kwargs())
                finally:
                    recording.autotune.pop()
        finally:
            recording.dry = False
        recording.autotune.append((0, len(configs)))
        try:
            return original(self, *args, **kwargs)
        finally:
            recording.autotune.pop()
    run.original = original
    return run


@contextlib.contextmanager
def cuda_emulation():
    """The CUDA path's kernels on CPU tensors, in Triton's interpreter, for the block's duration: the workarounds of
    the module docstring, and PIXELTRIAGE_EMULATE_CUDA=1 (so `kernels.registry` picks the CUDA kernels). Raises
    InterpreterHarnessError when triton is not interpreting (TRITON_INTERPRET=1 must be set before triton is first
    imported). Restores everything on exit."""
    if not interpreting():
        raise InterpreterHarnessError("Triton is not interpreting: set TRITON_INTERPRET=1 before triton is first "
                                      "imported (tests/conftest.py does on a machine without a GPU)")
    from triton.runtime import autotuner, interpreter

    if vars(interpreter.ASTTransformer).get("visit_For") is _visit_for:     # nested: the outer block restores
        yield
        return
    check_versions()
    check_internals()

    original_prune, original_dot = autotuner.Autotuner.prune_configs, interpreter.InterpreterBuilder.create_dot
    original_run, original_autotune = interpreter.InterpretedFunction.run, autotuner.Autotuner.run
    interpreter.ASTTransformer.visit_For = _visit_for
    interpreter.InterpretedFunction.rewritten_fn.clear()
    autotuner.Autotuner.prune_configs = _first_config(original_prune)
    interpreter.InterpreterBuilder.create_dot = tensor_core_dot(original_dot)
    interpreter.InterpretedFunction.run = _recording_run(original_run)
    autotuner.Autotuner.run = _recording_autotune(original_autotune)
    try:
        with settings.environment(**{EMULATE_CUDA: "1", "TRITON_INTERPRET": "1"}):
            yield
    finally:
        autotuner.Autotuner.prune_configs = original_prune
        autotuner.Autotuner.run = original_autotune
        interpreter.InterpreterBuilder.create_dot = original_dot
        interpreter.InterpretedFunction.run = original_run
        del interpreter.ASTTransformer.visit_For
        interpreter.InterpretedFunction.rewritten_fn.clear()


def emulating() -> bool:
    """Whether `cuda_emulation()` is active in this process."""
    from triton.runtime import interpreter

    return vars(interpreter.ASTTransformer).get("visit_For") is _visit_for


@contextlib.contextmanager
def record_launches(target, execute: bool = True):
    """Inside `cuda_emulation()`: yields the list of `Launch`es made in the block, each specialized as the compiler for
    `target` (a triton GPUTarget) would be; an autotuned launch also records every other config its autotuner
    would time (`ran=False`: recorded, not run). execute=False records the forward's launches without running them
    (their outputs stay as allocated): which kernels a forward launches, and how, does not depend on the values,
    since the CUDA forward reads none back to the host (tests/engine/test_cuda_branch.py)."""
    global _RECORDING
    if not emulating():
        raise RuntimeError("record_launches() runs inside cuda_emulation()")
    if _RECORDING is not None:
        raise RuntimeError("record_launches() does not nest")
    _RECORDING = _Recording(target=target, execute=execute)
    try:
        yield _RECORDING.launches
    finally:
        _RECORDING = None


# --- what flash-linear-attention sees of the GPU ------------------------------------------------------------------

@dataclass(frozen=True)
class TargetDevice:
    """The device properties fla's import and wrappers read, for one compile target."""
    name: str
    capability: tuple[int, int]
    smem_per_block: int          # opt-in maximum of dynamic shared memory per block, bytes
    smem_per_sm: int
    multiprocessors: int
    total_memory: int


TARGET_DEVICES = {
    "sm_80": TargetDevice("NVIDIA A100-SXM4-80GB", (8, 0), 166912, 167936, 108, 80 * 1024 ** 3),
    "sm_90": TargetDevice("NVIDIA H100 80GB HBM3", (9, 0), 232448, 233472, 132, 80 * 1024 ** 3),
}


class _IndexedByNone(list):
    """fla's per-device list of shared memory sizes, which its wrappers index with a tensor's device.index: None for
    a CPU tensor, read as device 0 (the emulated GPU)."""

    def __getitem__(self, i):
        return super().__getitem__(0 if i is None else i)


def emulate_target(target: str) -> None:
    """Make flash-linear-attention, imported after this call, see a GPU of `target` ("sm_80", "sm_90"): triton's active
    driver reports that target and its properties, torch.cuda's device queries answer for it (torch.cuda stays
    unavailable: no tensor goes to a device). For a process of its own; fla must not be imported yet."""
    import sys

    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    if "fla" in sys.modules:
        raise RuntimeError("emulate_target() must run before flash-linear-attention is imported")
    device = TARGET_DEVICES[target]
    major, minor = device.capability
    properties = {"max_shared_mem": device.smem_per_block, "multiprocessor_count": device.multiprocessors,
                  "max_num_regs": 65536, "warpSize": 32}

    class Driver:
        def __init__(self):
            self.utils = types.SimpleNamespace(get_device_properties=lambda index=0: dict(properties))

        def get_current_target(self):
            return GPUTarget("cuda", major * 10 + minor, 32)

        def get_current_device(self):
            return 0

        def get_device_capability(self, index=0):
            return device.capability

        def is_active(self):
            return True

    triton.runtime.driver.set_active(Driver())
    props = types.SimpleNamespace(name=device.name, major=major, minor=minor, total_memory=device.total_memory,
                                  multi_processor_count=device.multiprocessors,
                                  shared_memory_per_block_optin=device.smem_per_block,
                                  shared_memory_per_block=49152, shared_memory_per_multiprocessor=device.smem_per_sm)
    torch.cuda.get_device_name = lambda index=None: device.name
    torch.cuda.get_device_capability = lambda index=None: device.capability
    torch.cuda.get_device_properties = lambda index=None: props
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    import fla.utils.hardware as hardware

    read = hardware.get_all_max_shared_mem
    hardware.get_all_max_shared_mem = lambda: _IndexedByNone(read())


def fla_view() -> dict:
    """What flash-linear-attention decided about the device at import (for the compile report)."""
    from fla.utils import hardware

    return {"device": hardware.device_platform, "hopper": hardware.IS_NVIDIA_HOPPER,
            "tf32": hardware.IS_TF32_SUPPORTED, "tma": hardware.IS_TMA_SUPPORTED,
            "smem>=hopper": hardware.check_shared_mem("hopper"), "smem>=ampere": hardware.check_shared_mem("ampere"),
            "smem>=ada": hardware.check_shared_mem("ada")}
