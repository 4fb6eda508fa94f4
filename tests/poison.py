"""NaN-poisoned allocations: inside `NanPoisonedEmpty()`, every floating tensor that empty()/empty_like()/new_empty()
(and their strided forms) return is filled with NaN, so a kernel that reads memory it never wrote fails its test."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class NanPoisonedEmpty(TorchDispatchMode):
    """Fills every floating tensor that empty()/empty_like()/new_empty() returns with NaN."""

    EMPTY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
             torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty_strided.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.EMPTY and out.is_floating_point():
            out.fill_(float("nan"))
        return out
