"""What the forward must not do on a GPU, recorded on any device: host synchronisations and host data uploads.

`HostSyncs` records, inside its block, every op that makes a CUDA host wait for the device or copies host data
into the forward:

- a scalar read on the host: `aten._local_scalar_dense` (`.item()`, `bool(t)`, `int(t)`, `float(t)`, `if t:`),
  `aten.is_nonzero`, `aten.equal`;
- an op whose output shape depends on the data: `nonzero` (and `torch.where(cond)`), `masked_select`,
  boolean-mask indexing (`x[mask]`, `x[mask] = y`), `unique*`, `repeat_interleave` with tensor repeats and
  no `output_size`, `bincount`;
- a tensor made from Python data (`torch.tensor(list)`, `torch.as_tensor(list)`, `x[[1, 2]]`: `aten.lift_fresh`)
  and every copy between devices (`aten._to_copy` / `copy_` from one device type to another): an upload of host
  data, or a download, inside the forward;
- at the Python level, what a CPU tensor does without any aten op: `.tolist()`, `.item()`, `.cpu()`, `.numpy()`.

On a CPU nothing synchronises, so the recorder treats every tensor as a device tensor: a forward that passes here
makes none of these calls, whatever device runs it. Events raised by Triton's interpreter copying a kernel's arguments
to the host and back (`GridExecutor._init_args_hst`, `_restore_args_dev`: what a GPU launch never does) are not
recorded; everything else a launch runs on the host is, a grid callable, an autotuner's pruning and hooks, a
wrapper's code, as on a GPU, where they run on the host too.

`HostSyncs(trace=True)` also keeps each op's name and its tensors' shapes and dtypes (`trace`), and checks that
every tensor an op reads was made inside the block or belongs to `allowed` (static buffers, weights): what a CUDA
graph capture needs, since a replay reads every input at the address it had when captured (`foreign`).
"""
from __future__ import annotations

import dataclasses
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

SYNC_OPS = {
    aten._local_scalar_dense: "a scalar read on the host (.item(), bool(), int(), float())",
    aten.is_nonzero: "a scalar read on the host (bool of a one-element tensor)",
    aten.equal: "torch.equal (a scalar read on the host)",
    aten.nonzero: "nonzero (its output size is read on the host)",
    aten.masked_select: "masked_select (its output size is read on the host)",
    aten._unique: "unique (its output size is read on the host)",
    aten._unique2: "unique (its output size is read on the host)",
    aten.unique_dim: "unique (its output size is read on the host)",
    aten.unique_consecutive: "unique_consecutive (its output size is read on the host)",
    aten.unique_dim_consecutive: "unique_consecutive (its output size is read on the host)",
    aten.bincount: "bincount (its output size is read on the host)",
    aten.lift_fresh: "a tensor made from Python data (an upload)",
    aten.lift_fresh_copy: "a tensor made from Python data (an upload)",
}
INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
REPEAT_OPS = {aten.repeat_interleave}
COPY_OPS = {aten._to_copy, aten.copy_}
PYTHON_CALLS = {
    torch.Tensor.tolist: ".tolist() (a download)",
    torch.Tensor.item: ".item() (a scalar read on the host)",
    torch.Tensor.cpu: ".cpu() (a download)",
    torch.Tensor.numpy: ".numpy() (a download)",
}
_TORCH_DIR = str(Path(torch.__file__).parent)
_THIS = str(Path(__file__))


@dataclass(frozen=True)
class Event:
    what: str       # the op and why it synchronises
    where: str      # the innermost frame outside torch: file:line in function

    def __str__(self) -> str:
        return f"{self.what} at {self.where}"


INTERPRETER_COPIES = ("_init_args_hst", "_restore_args_dev")    # triton/runtime/interpreter.py's GridExecutor


def _caller() -> tuple[str, bool]:
    """(the innermost frame outside torch and this file, whether Triton's interpreter is copying a kernel's
    arguments: `INTERPRETER_COPIES` on the stack)."""
    frames = traceback.extract_stack()
    copying = any(f.name in INTERPRETER_COPIES and "triton/runtime/interpreter" in f.filename for f in frames)
    for f in reversed(frames):
        if not f.filename.startswith(_TORCH_DIR) and f.filename != _THIS:
            return f"{f.filename}:{f.lineno} in {f.name}", copying
    return "?", copying


def tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor of a (weights) dataclass, nested dataclasses and lists included: `allowed` of a graph's region."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_of(item)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in tensors_of(getattr(obj, f.name))]
    return []


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _device_of(value) -> torch.device | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.device
    try:
        return torch.device(value)
    except (TypeError, RuntimeError):
        return None


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "HostSyncs"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = self.owner._why(func, args, kwargs)
        if why is not None:
            self.owner._add(why)
        self.owner._check_inputs(func, args, kwargs)
        out = func(*args, **kwargs)
        self.owner._made(func, args, kwargs, out)
        return out


class _Functions(TorchFunctionMode):
    def __init__(self, owner: "HostSyncs"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = PYTHON_CALLS.get(func)
        if why is not None:
            self.owner._add(why)
        return func(*args, **kwargs)


class HostSyncs:
    """Records the host synchronisations and uploads of the ops inside its block (see the module docstring).

    trace: also record every op with its tensors' shapes and dtypes, and the tensors read that were neither made
    inside the block nor among `allowed` (their storages)."""

    def __init__(self, trace: bool = False, allowed=()):
        self.events: list[Event] = []
        self.trace: list[tuple] = []
        self.foreign: list[str] = []
        self._tracing = trace
        self._allowed = {t.untyped_storage().data_ptr() for t in allowed}
        self._made_here: set[int] = set()
        self._modes = (_Functions(self), _Dispatch(self))

    def __enter__(self) -> "HostSyncs":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def _add(self, what: str) -> None:
        where, copying = _caller()
        if not copying:
            self.events.append(Event(what, where))

    def _why(self, func, args, kwargs) -> str | None:
        packet = func.overloadpacket
        if packet in SYNC_OPS:
            return f"{func}: {SYNC_OPS[packet]}"
        if packet in INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
                return f"{func}: boolean-mask indexing (the mask is counted on the host)"
        if packet in REPEAT_OPS and func is not aten.repeat_interleave.self_int and kwargs.get("output_size") is None:
            return f"{func}: repeat_interleave with tensor repeats and no output_size (their sum is read on the host)"
        if packet in COPY_OPS:
            src = args[1] if packet is aten.copy_ else args[0]
            dst = args[0].device if packet is aten.copy_ else (_device_of(kwargs.get("device")) or src.device)
            if isinstance(src, torch.Tensor) and src.device.type != dst.type:
                return f"{func}: a copy from {src.device.type} to {dst.type}"
        return None

    def _check_inputs(self, func, args, kwargs) -> None:
        if not self._tracing:
            return
        inputs = _tensors((args, kwargs))
        self.trace.append((str(func), tuple((tuple(t.shape), t.dtype) for t in inputs)))
        for t in inputs:
            storage = t.untyped_storage().data_ptr()
            if t.numel() and storage not in self._allowed and storage not in self._made_here:
                where, _ = _caller()
                self.foreign.append(f"{func} reads a {tuple(t.shape)} {t.dtype} tensor made outside the block, "
                                    f"at {where}")

    def _made(self, func, args, kwargs, out) -> None:
        if self._tracing:
            self._made_here.update(t.untyped_storage().data_ptr() for t in _tensors(out) if t.numel())
            self.trace[-1] += (tuple((tuple(t.shape), t.dtype) for t in _tensors(out)),)

    def check(self) -> None:
        """AssertionError listing every event (and, when tracing, every tensor read from outside the block)."""
        problems = [str(e) for e in self.events] + self.foreign
        if problems:
            raise AssertionError(f"{len(problems)} host synchronisations or uploads inside the region:\n  "
                                 + "\n  ".join(problems))
