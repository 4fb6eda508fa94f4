"""Weights in oneDNN's blocked layout, reordered once instead of in every product (bf16, and float32 where its
projections run oneDNN's primitive).

torch's bf16 matmul on the CPU is oneDNN's already, but it is handed the weight in its plain [N, K] layout, so each
call copies the blocks of it that a thread needs into the layout the kernel reads (pairs of K rows interleaved for
the bf16 dot products); oneDNN's linear primitive, which the vision tower's layers run for their bias and
activation epilogue, reorders a plain weight on every call. `Packed` reorders the weight once
(`mkldnn._reorder_linear_weight`) and runs the primitive on it: the same kernel and the same sums, without the
copies. On an AVX512-BF16 EPYC (2 threads), each product against the plain weight's: bench-small's decoder (2296
rows) in_proj and gate_up 0.922x their time, qkv 0.942x, down 0.946x, out_proj 0.954x, 2b's 0.933-0.956x; the
vision tower's 0.84-0.89x; the outputs the same bits. Whether it is faster is the machine's to say (on an AMX Xeon
gate_up and in_proj measured slower packed, down and out_proj faster): measured once per machine (`choice`: a
[2048, 1024] x [1024, 4096] product both ways, kept by `tuning` as "bf16 prepacked weights").

Which weights (`packed_roles`): the decoder's six products, by role, and "vision", the vision tower's linear
layers. Three of them (in_proj, qkv, gate_up) write the forward's widest outputs, which the Scorer's workspace
(`kernels.workspace`) keeps warm where malloc is left as the host has it; oneDNN's primitive has no output argument,
so a packed weight gives up that buffer. Those three are packed only where that costs nothing: malloc tuned
(`engine.cpu_memory.tune_malloc`, which the CLI and the server call) or the workspace off; the others (out_proj,
o_proj, down, vision) wherever packing is chosen.

`pack_in_place(weights, cfg, roles)` replaces each chosen weight by a `Packed` (or, for a weight the forward slices
by rows, a `Rows` of packed and plain parts; both in `kernels.onednn_weights`, which `kernels.linear` runs) and lets
the plain one go: no second copy is kept. A Scorer decides its roles at load (`chosen_roles`; `Scorer.load(...,
reorder_weights=False)`: none) and packs them in its first forward (`OnFirstForward`).
CPU only: bf16 where oneDNN has bf16 primitives for this CPU; float32 where the projections run oneDNN's primitive
(`kernels.linear`), every role (none writes into the workspace there), measured under its own record (malloc
tuned, [2048, 1024] x [1024, 4096]: 0.953x here; the forward 0.950x).

`PIXELTRIAGE_PREPACK`: auto (the default) as above, on: pack where possible without measuring, off: never.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterator, Sequence

import torch

from pixeltriage import settings
from pixeltriage.kernels import linear, registry, tuning, workspace
from pixeltriage.kernels.onednn_weights import Packed, Rows

SWITCH = "PIXELTRIAGE_PREPACK"
# the choice's record per dtype (`tuning`)
RECORDS = {torch.bfloat16: "bf16 prepacked weights", torch.float32: "float32 prepacked weights"}
# The product the choice is timed on (a decoder projection's order of size), and the margin packing must win by
MEASURE_SHAPE = (2048, 1024, 4096)
MARGIN = 0.97
# The decoder's products by role; the first three write into the workspace's buffers of the same names
WORKSPACE_ROLES = ("in_proj", "qkv", "gate_up")
# ... and those that do not: the decoder's other three, and "vision", every linear layer of the vision tower (patch
# embedding, each block's qkv, proj, fc1, fc2, the merger's two; with their bias and activation in the primitive)
OTHER_ROLES = ("out_proj", "o_proj", "down", "vision")
ROLES = WORKSPACE_ROLES + OTHER_ROLES
VISION_BLOCK_FIELDS = ("qkv_w", "proj_w", "fc1_w", "fc2_w")
VISION_FIELDS = ("patch_w", "merger_fc1_w", "merger_fc2_w")


def switch() -> str:
    """PIXELTRIAGE_PREPACK (`pixeltriage.settings`): "auto", "on" or "off"."""
    return settings.current().prepack


def measure(dtype: torch.dtype = torch.bfloat16, shape: tuple[int, int, int] = MEASURE_SHAPE, pairs: int = 7) -> dict:
    """A packed weight's product against the plain weight's as the forward runs it (bf16: torch's product; float32:
    oneDNN's primitive, where `applies`), in `dtype`, `shape` = (M, K, N), interleaved: the record `tuning` keeps
    ({"layout": "packed" where the packed one took under MARGIN of the plain one's time, else "plain";
    "packed_over_plain": the pairs' median ratio, "quartiles", "shape", "pairs", "measured"}); where the primitive
    raises, {"layout": "plain", "error": its message, ...}."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)
    record = {"shape": list(shape), "pairs": pairs, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        packed = Packed(w)
        plain = (lambda: torch.mm(x, w.t())) if dtype == torch.bfloat16 else \
            (lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
        ratios = tuning.interleaved_ratio(plain, lambda: packed(x), pairs=pairs)
    except RuntimeError as e:                      # a torch whose primitive refuses this CPU: plain
        return {"layout": "plain", "error": str(e).splitlines()[0][:300] if str(e) else type(e).__name__, **record}
    ratio = ratios[len(ratios) // 2]
    return {"layout": "packed" if ratio < MARGIN else "plain", "packed_over_plain": round(ratio, 4),
            "quartiles": [round(ratios[len(ratios) // 4], 4), round(ratios[3 * len(ratios) // 4], 4)], **record}


def choice(dtype: torch.dtype = torch.bfloat16) -> dict:
    """This machine's measured layout for weights in `dtype` (`measure`'s record, kept by `tuning`)."""
    return tuning.measured(RECORDS[dtype], lambda: measure(dtype))


def applies(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """None where weights may be packed for a forward on `device` in `dtype`, else why not (a forward that runs the
    CUDA kernels, CPU tensors under the test switch included: `registry.kernel_device`)."""
    if registry.kernel_device(device) != "cpu":
        return "cuda forward"
    if dtype not in RECORDS:
        return f"{dtype} forward"
    if switch() == "off":
        return f"{SWITCH}=off"
    if dtype == torch.bfloat16 and not linear.onednn_available(torch.bfloat16):
        return "no oneDNN bf16 linear primitive for this CPU"
    if dtype == torch.float32 and not linear.plain_onednn("cpu", torch.float32):
        return "float32 projections on F.linear here (kernels.linear), not oneDNN's primitive"
    return None


def packed_roles(malloc_tuned: bool, workspace_on: bool, dtype: torch.dtype = torch.bfloat16) -> tuple[str, ...]:
    """The roles whose weights are packed (where packing is chosen): all where malloc is tuned or the workspace is
    off, or in float32 (whose products are oneDNN's primitive's already: none writes into the workspace), else those
    without a workspace buffer (see the module)."""
    return ROLES if malloc_tuned or not workspace_on or dtype == torch.float32 else OTHER_ROLES


def chosen_roles(device: torch.device | str, dtype: torch.dtype) -> tuple[str, ...]:
    """The roles a Scorer loaded now for `device` and `dtype` packs: none where packing does not apply or this
    machine measured it slower (measured here the first time), else `packed_roles` for this process."""
    if applies(device, dtype) is not None or (switch() == "auto" and choice(dtype)["layout"] != "packed"):
        return ()
    return packed_roles(tuning.malloc_tuned, workspace.enabled(), dtype)


def _check_roles(roles: Sequence[str]) -> None:
    unknown = set(roles) - set(ROLES)
    if unknown:
        raise ValueError(f"unknown prepack roles {sorted(unknown)}; known: {list(ROLES)}")


def _places(weights) -> Iterator[tuple[str, object, str]]:
    """(role, owner, field) of every weight a role covers in `weights` (EngineWeights): the one table
    `pack_in_place` and `roles_of` read."""
    for layer in weights.text.layers:       # a full-attention layer's weights have qkv, a Gated DeltaNet's in_proj
        for name in ("qkv", "o_proj") if hasattr(layer.attn, "qkv") else ("in_proj", "out_proj"):
            yield name, layer.attn, name
        yield "gate_up", layer, "gate_up"
        yield "down", layer, "down"
    for block in weights.vision.blocks:
        for name in VISION_BLOCK_FIELDS:
            yield "vision", block, name
    for name in VISION_FIELDS:
        yield "vision", weights.vision, name


def pack_in_place(weights, cfg, roles: Sequence[str],
                  release: Callable[[torch.Tensor], object] | None = None) -> None:
    """Replace the weights of `roles` in `weights` (EngineWeights; its layer objects changed in place) by packed
    ones; those already packed are left. cfg: the text config. The last layer's qkv, which the forward's last rows
    slice into query and key/value parts, is kept as those two parts; in_proj as its packed main part and its plain
    b/a rows (a float32 projection). Each plain weight is let go as soon as it is replaced, so that at most one is
    held twice; release: called with it then (the Scorer's gives a mapped file's pages back: `weights.pages`)."""
    _check_roles(roles)
    last_attn = weights.text.layers[-1].attn
    q_width = cfg.num_attention_heads * 2 * cfg.head_dim
    n_main = cfg.linear_conv_dim + cfg.linear_value_dim
    for role, owner, name in _places(weights):
        plain = getattr(owner, name)
        if role not in roles or not isinstance(plain, torch.Tensor):
            continue
        if name == "qkv" and owner is last_attn:
            packed = Rows([0, q_width, plain.shape[0]], [Packed(plain[:q_width]), Packed(plain[q_width:])])
        elif name == "in_proj":            # b/a: [2 Hv, hidden], copied out of the plain weight so that it can go
            packed = Rows([0, n_main, plain.shape[0]], [Packed(plain[:n_main]), plain[n_main:].clone()])
        else:
            packed = Packed(plain)
        setattr(owner, name, packed)
        if release is not None:
            release(plain)


class OnFirstForward:
    """The roles a Scorer's weights are to be packed in (`chosen_roles`, decided at load), packed in place by the
    first forward that calls `apply` (one thread packs, a concurrent one waits for it): a load stays a mapping of the
    file, and the reorder (its cost: docs/performance.md, "Weights reordered for oneDNN once") is paid where the
    weights are first read anyway, by the first forward (the server's warm-up).
    Shared by the Scorers on the same weights (`Scorer.with_cache`)."""

    def __init__(self, roles: Sequence[str] = (), release: Callable[[torch.Tensor], object] | None = None) -> None:
        _check_roles(roles)
        self.roles = tuple(r for r in ROLES if r in roles)
        self.done = not self.roles
        self._release = release
        self._lock = threading.Lock()

    def apply(self, weights, cfg) -> None:
        """Pack `weights`' (EngineWeights) weights of `roles` in place, once; after that a flag's check. cfg: the
        text config."""
        if self.done:
            return
        with self._lock:
            if not self.done:
                pack_in_place(weights, cfg, self.roles, self._release)
                self.done, self._release = True, None


def roles_of(weights) -> tuple[str, ...]:
    """The roles whose weights are packed in `weights` (EngineWeights), in ROLES' order."""
    found = {role for role, owner, name in _places(weights) if isinstance(getattr(owner, name), (Packed, Rows))}
    return tuple(r for r in ROLES if r in found)
