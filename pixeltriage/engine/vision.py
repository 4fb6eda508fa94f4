"""System One's vision tower: patches -> ViT (full attention within each image) -> merged visual rows."""
from __future__ import annotations

import torch

from pixeltriage.config import VisionConfig
from pixeltriage.engine.profiling import stage
from pixeltriage.kernels.attention import segment_attention
from pixeltriage.kernels.linear import in_row_blocks, linear, linear_act
from pixeltriage.kernels.norm import add_layer_norm
from pixeltriage.kernels.onednn_weights import packed_label
from pixeltriage.kernels.rotary import apply_rotary_float, vision_rotary_cos_sin
from pixeltriage.weights.layout import VisionBlockWeights, VisionWeights

EPS = 1e-6   # the ViT's LayerNorm epsilon


def block_order_coords(grid_h: int, grid_w: int, merge: int, device=None) -> torch.Tensor:
    """(row, col) of each patch in the processor's order: merge x merge blocks, row-major. -> [h*w, 2]."""
    rows = torch.arange(grid_h, device=device).view(grid_h // merge, merge, 1, 1).expand(-1, -1, grid_w // merge, merge)
    cols = torch.arange(grid_w, device=device).view(1, 1, grid_w // merge, merge).expand(grid_h // merge, merge, -1, -1)
    # [bh, mh, bw, mw] -> [bh, bw, mh, mw]
    rows, cols = rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)
    return torch.stack([rows, cols], dim=-1)


def interpolated_pos_embed(pos_embed: torch.Tensor, coords: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """Bilinear (align_corners=True) resampling of the square learned table at each patch. -> [N, hidden]."""
    side = int(pos_embed.shape[0] ** 0.5)

    def taps(index: torch.Tensor, size: int):
        src = index.float() * (side - 1) / max(size - 1, 1)
        lo = src.floor()
        frac = src - lo
        lo = lo.long().clamp(0, side - 1)
        return lo, (lo + 1).clamp(max=side - 1), 1 - frac, frac

    r0, r1, wr0, wr1 = taps(coords[:, 0], grid_h)
    c0, c1, wc0, wc1 = taps(coords[:, 1], grid_w)
    table = pos_embed.float()
    out = (table[r0 * side + c0] * (wr0 * wc0)[:, None] + table[r0 * side + c1] * (wr0 * wc1)[:, None]
           + table[r1 * side + c0] * (wr1 * wc0)[:, None] + table[r1 * side + c1] * (wr1 * wc1)[:, None])
    return out


def vision_forward(pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]], weights: VisionWeights,
                   cfg: VisionConfig) -> torch.Tensor:
    """pixel_values: [P, patch_dim] for images with grids (t, h, w) in patches.

    Returns merged visual rows [P / merge^2, out_hidden] in the weights' dtype.
    """
    with stage("vision"):
        return _vision_forward(pixel_values, grid_thw, weights, cfg)


def _vision_forward(pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]], weights: VisionWeights,
                    cfg: VisionConfig) -> torch.Tensor:
    dtype = weights.patch_w.dtype
    device = pixel_values.device
    merge = cfg.spatial_merge_size
    coords, pos, per_grid = [], [], {}
    for grid in map(tuple, grid_thw):           # an image's coordinates and position embeddings depend on its grid
        if grid not in per_grid:                # only: computed once per distinct grid (a batch's thumbnails share one)
            t, h, w = grid
            c = block_order_coords(h, w, merge, device).repeat(t, 1)
            per_grid[grid] = c, interpolated_pos_embed(weights.pos_embed, c, h, w)
        coords.append(per_grid[grid][0])
        pos.append(per_grid[grid][1])
    coords_all = torch.cat(coords)
    # The residual stream stays in float32; matmuls run in the weights' dtype.
    x = linear(pixel_values.to(dtype), weights.patch_w, weights.patch_b).float() + torch.cat(pos)
    cos, sin = vision_rotary_cos_sin(coords_all, cfg.head_dim, cfg.rope_theta)
    lengths = [h * w for t, h, w in grid_thw for _ in range(t)]
    pending = None                # the last sub-block's output, added to x together with the next norm
    for block in weights.blocks:                      # x is this function's own float32 residual: updated in place
        y = add_layer_norm(x, pending, block.norm1_w, block.norm1_b, EPS, dtype)                  # x += pending; LN(x)
        pending = vision_attention(y, block, cfg, cos, sin, lengths)
        y = add_layer_norm(x, pending, block.norm2_w, block.norm2_b, EPS, dtype)
        pending = vision_mlp(y, block, cfg)
    x = add_layer_norm(x, pending, weights.merger_norm_w, weights.merger_norm_b, EPS, dtype)
    x = x.view(-1, cfg.hidden_size * cfg.merge_unit)
    x = linear_act(x, weights.merger_fc1_w, weights.merger_fc1_b, "gelu")
    return linear(x, weights.merger_fc2_w, weights.merger_fc2_b)


def vision_mlp(x: torch.Tensor, block: VisionBlockWeights, cfg: VisionConfig) -> torch.Tensor:
    """fc2(act(fc1(x))), in row blocks where this machine measured that faster for the shape and the weights' layout
    (`in_row_blocks`)."""
    def mlp(t: torch.Tensor) -> torch.Tensor:
        return linear(linear_act(t, block.fc1_w, block.fc1_b, cfg.hidden_act), block.fc2_w, block.fc2_b)

    label = f"ViT MLP [{x.shape[1]} -> {block.fc1_w.shape[0]}] {x.dtype}{packed_label(block.fc1_w, block.fc2_w)}"
    return in_row_blocks(mlp, x, label)


def vision_attention(x: torch.Tensor, block: VisionBlockWeights, cfg: VisionConfig, cos: torch.Tensor,
                     sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Full (non-causal) attention within each image. x: [N, hidden]."""
    n = x.shape[0]
    qkv = linear(x, block.qkv_w, block.qkv_b).view(n, 3, cfg.num_heads, cfg.head_dim)
    q, k = apply_rotary_float(qkv[:, :2], cos, sin).unbind(1)   # q and k in one pass
    v = qkv[:, 2]
    with stage("vision_attention"):                 # nested in "vision": QK^T, softmax and PV timed apart
        o = segment_attention(q, k, v, lengths, causal=False).reshape(n, -1)
    return linear(o, block.proj_w, block.proj_b)
