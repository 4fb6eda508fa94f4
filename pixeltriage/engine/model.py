"""System One's hybrid text decoder: Gated DeltaNet and gated full-attention layers, SwiGLU MLPs.

Parameters live in the engine's fused layout (see `pixeltriage/weights/layout.py`); the forward
returns the last decoder output before the final norm, which the head applies only at its rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from pixeltriage.config import FULL, TextConfig
from pixeltriage.engine.profiling import stage
from pixeltriage.kernels import registry
from pixeltriage.kernels.activation import sigmoid_gate_, silu_mul
from pixeltriage.kernels.attention import rows_attention, segment_attention
from pixeltriage.kernels.gated_delta import GATED_DELTA
from pixeltriage.kernels.linear import in_row_blocks, linear
from pixeltriage.kernels.norm import add_rms_norm, rms_norm_gated
from pixeltriage.kernels.onednn_weights import packed_label, row_slice
from pixeltriage.kernels.rotary import mrope_cos_sin, norm_partial_rotary
from pixeltriage.weights.layout import FullAttentionWeights, LayerWeights, LinearAttentionWeights, TextWeights


@dataclass(frozen=True)
class Varlen:
    """Several states packed along the token axis, prepared once before the forward (`Varlen.prepare`), so that
    no layer makes a tensor from the boundaries or reads one back: no upload and no host sync inside the forward.

    bounds: [0, t1, ..., T] as ints, read on the host (segment lengths, the C kernels, the torch paths).
    device_bounds: the same as int64 on the forward's device, for fla's varlen kernels; None where the CPU's
    kernels run (`registry.kernel_device`), which have no use for it.
    segments: [T] int64, each token's state (on the forward's device): the mask of `rows_attention`."""
    bounds: list[int]
    device_bounds: torch.Tensor | None
    segments: torch.Tensor

    @property
    def lengths(self) -> list[int]:
        """Each packed state's token count, from `bounds`."""
        return [e - b for b, e in zip(self.bounds, self.bounds[1:])]

    @classmethod
    def prepare(cls, bounds: Sequence[int], device: str | torch.device) -> "Varlen":
        device = torch.device(device)
        bounds = [int(b) for b in bounds]
        if len(bounds) < 2 or bounds[0] != 0 or any(e < b for b, e in zip(bounds, bounds[1:])):
            raise ValueError(f"varlen boundaries must rise from 0, got {bounds}")
        segments = torch.empty(bounds[-1], dtype=torch.long)
        for i, (b, e) in enumerate(zip(bounds, bounds[1:])):     # slice fills: ~2 us each, where repeat_interleave
            segments[b:e] = i                                    # and bucketize took 0.5-1 ms at 3k tokens
        device_bounds = None
        if registry.kernel_device(device) == "cuda":
            device_bounds = torch.tensor(bounds, dtype=torch.long).to(device)
        return cls(bounds, device_bounds, segments.to(device))


def gated_delta_net(x: torch.Tensor, w: LinearAttentionWeights, cfg: TextConfig, varlen: Varlen | None = None,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, hidden] -> [T, hidden]; varlen: the states packed along T.
    rows: only these output rows ([R] indices into T, on x's device) -> [R, hidden]; the recurrence still runs
    over every token, the output norm and projection only at the rows."""
    seq_len = x.shape[0]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    n_main = cfg.linear_conv_dim + cfg.linear_value_dim
    # the workspace's "in_proj" (where a workspace is active): read through z after the delta rule
    # (in_proj may be kept as its packed main part and its plain b/a rows: `kernels.prepack`)
    qkv, z = linear(x, row_slice(w.in_proj, 0, n_main), into="in_proj").split([cfg.linear_conv_dim,
                                                                                cfg.linear_value_dim], dim=-1)
    # b and a become beta and the log decay, whose errors compound through the decay's cumulative sums: they
    # leave their (2 * Hv-column) projection in float32, never rounded to bf16. On the parity checkpoints this
    # alone took the bf16-vs-float32 score gap from 0.021 to 0.004 where it was largest.
    b, a = (x.float() @ row_slice(w.in_proj, n_main).float().t()).split([hv, hv], dim=-1)
    # beta and the log decay in float64, rounded once to float32. torch's vectorised sigmoid/softplus/exp and their
    # scalar loop over the last (size % 16) elements differ by an ulp, so in float32 the last tokens of a state (where
    # its decision rows are) got beta and g that depended on what else shared its varlen batch whenever T * Hv is
    # not a multiple of 16 (Hv = 2 in a test config: batch and single scores 1.5e-6 apart); float64's ulp is gone
    # after the rounding. [T, Hv] is small: microseconds.
    beta = b.double().sigmoid().float()
    g = (-w.A_log.double().exp() * F.softplus(a.double() + w.dt_bias.double())).float()
    # the conv + SiLU, q and k L2-normalised, the delta rule: [T, Hv, dv] float32, by the "gated_delta" op's kernel
    # (fla's on CUDA in bf16/fp16, the chunked rule in float32 there; the C passes on the CPU)
    bounds, device_bounds = (None, None) if varlen is None else (varlen.bounds, varlen.device_bounds)
    with stage("delta_rule"):                               # timed apart from the projections around it
        o = GATED_DELTA(qkv, w.conv, g, beta, hk, dk, hv, dv, bounds, device_bounds)
    z = z.view(seq_len, hv, dv)
    if rows is not None:
        o, z = o.index_select(0, rows), z.index_select(0, rows)
    o = rms_norm_gated(o, z, w.norm, cfg.rms_norm_eps)
    return linear(o.reshape(o.shape[0], -1), w.out_proj)


def gated_attention(x: torch.Tensor, w: FullAttentionWeights, cfg: TextConfig, cos: torch.Tensor,
                    sin: torch.Tensor, varlen: Varlen | None = None,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """Causal grouped-query attention with q/k RMSNorm, partial M-RoPE and a sigmoid output gate; with
    varlen, causal within each packed sequence only.
    rows: only these output rows ([R] indices into T, on x's device) -> [R, hidden]: keys and values over every
    token, queries, gates and the output projection at the rows only."""
    seq_len = x.shape[0]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q_width = nh * 2 * hd
    if rows is None:          # the workspace's "qkv" (where one is active) is read through the gate, at the end
        qg, k, v = linear(x, w.qkv, into="qkv").split([q_width, nkv * hd, nkv * hd], dim=-1)
        q_cos, q_sin = cos, sin
    else:
        k, v = linear(x, row_slice(w.qkv, q_width), into="qkv").split([nkv * hd, nkv * hd], dim=-1)
        qg = linear(x.index_select(0, rows), row_slice(w.qkv, 0, q_width))
        q_cos, q_sin = cos.index_select(0, rows), sin.index_select(0, rows)
    num_q = qg.shape[0]
    q, gate = qg.view(num_q, nh, 2 * hd).chunk(2, dim=-1)
    q = norm_partial_rotary(q, w.q_norm, cfg.rms_norm_eps, q_cos, q_sin)
    k = norm_partial_rotary(k.view(seq_len, nkv, hd), w.k_norm, cfg.rms_norm_eps, cos, sin)
    v = v.view(seq_len, nkv, hd)
    if rows is None:
        lengths = [seq_len] if varlen is None else varlen.lengths
        o = segment_attention(q, k, v, lengths, causal=True)                   # [T, nh, hd]
    else:
        segments = None if varlen is None else varlen.segments
        o = rows_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), rows, segments).transpose(0, 1)
    # the gate straight from its strided half of the projection, into the attention output in place: no copies of
    # either
    o = sigmoid_gate_(o, gate).reshape(num_q, nh * hd)
    return linear(o, w.o_proj)


def mlp(x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
    """down(silu(gate) * up), in row blocks where this machine measured that faster for the shape and the weights'
    layout (`in_row_blocks`); gate_up and the SwiGLU product in the workspace's buffers where one is active (each
    read before the next block's)."""
    label = f"decoder MLP [{x.shape[1]} -> {layer.down.shape[1]}] {x.dtype}{packed_label(layer.gate_up, layer.down)}"
    return in_row_blocks(lambda t: linear(silu_mul(linear(t, layer.gate_up, into="gate_up"), into="swiglu"),
                                          layer.down), x, label)


def decoder_forward(embeds: torch.Tensor, position_ids: torch.Tensor, weights: TextWeights,
                    cfg: TextConfig, cu_seqlens: Varlen | Sequence[int] | None = None,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """embeds: [T, hidden] (text embeddings with visual rows scattered in); position_ids: [3, T].
    cu_seqlens: when several independent states are packed along T, their `Varlen` (or its boundaries
    [0, t1, ..., T], prepared here): attention, conv and the delta rule never cross a boundary, so each state's
    rows equal its own forward. Callers on the hot path (the scorer) prepare the Varlen before the forward: the
    forward itself then makes no tensor from host data and reads none back (tests/engine/test_host_syncs.py).

    Returns the last layer's output [T, hidden] float32, before the final norm. The residual stream
    is kept in float32 whatever the weights' dtype; matmuls run in the weights' dtype.

    rows: [R] token indices (on embeds' device) -> only those output rows, [R, hidden], in that order. Nothing
    after the last layer's token mixer reads another row, so from there on only the rows are computed: the
    last layer's queries, gates, output projection and MLP (for a last Gated DeltaNet layer, its output norm,
    projection and MLP). The scorer asks for the head's n + 7 rows per state: at bench-small (8 layers) that
    is ~1/8 of the decoder's matmuls left out.
    """
    dtype = weights.embed.dtype
    eps = cfg.rms_norm_eps
    cos, sin = mrope_cos_sin(position_ids, cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section)
    varlen = cu_seqlens
    if varlen is not None and not isinstance(varlen, Varlen):
        varlen = Varlen.prepare(varlen, embeds.device)
    h = embeds.to(torch.float32, copy=True)          # the residual stream, updated in place from here on
    last = len(weights.layers) - 1
    pending = None                                   # the last MLP's output, added to h together with the next norm
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, weights.layers)):
        only = rows if i == last else None
        with stage("attention" if kind == FULL else "gated_delta"):
            x = add_rms_norm(h, pending, layer.input_norm, eps, dtype)           # h += pending; norm(h)
            if kind == FULL:
                mixed = gated_attention(x, layer.attn, cfg, cos, sin, varlen, only)
            else:
                mixed = gated_delta_net(x, layer.attn, cfg, varlen, only)
            if only is not None:
                h = h.index_select(0, only)
        with stage("mlp"):
            pending = mlp(add_rms_norm(h, mixed, layer.post_norm, eps, dtype), layer)   # h += mixed; norm(h)
    if pending is not None:
        h += pending
    return h
