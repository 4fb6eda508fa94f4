"""The gated delta rule's input checks, shared by every kernel of the op (chunk, bf16, fla) and imported by each
from here, below all of them."""
from __future__ import annotations

import torch


def check_projection(x: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     num_k_heads: int, k_dim: int, v_dim: int, num_v_heads: int | None = None) -> int:
    """ValueError unless x [T, conv_dim] holds num_k_heads key heads of k_dim and Hv value heads of v_dim (Hv, a
    multiple of num_k_heads: num_v_heads, or None: from beta [T, Hv]), conv_weight is [conv_dim, W] and g and beta
    are [T, Hv]; returns Hv."""
    seq_len, conv_dim = x.shape
    num_v_heads = beta.shape[1] if num_v_heads is None else num_v_heads
    if (num_k_heads < 1 or conv_dim != 2 * num_k_heads * k_dim + num_v_heads * v_dim or num_v_heads % num_k_heads
            or conv_weight.dim() != 2 or conv_weight.shape[0] != conv_dim):
        raise ValueError(f"projection width {conv_dim} (conv weight {tuple(conv_weight.shape)}) does not hold "
                         f"{num_k_heads} key heads of {k_dim} and {num_v_heads} value heads of {v_dim}")
    if g.shape != (seq_len, num_v_heads) or beta.shape != (seq_len, num_v_heads):
        raise ValueError(f"g and beta [{seq_len}, {num_v_heads}] expected, got {tuple(g.shape)}, {tuple(beta.shape)}")
    return num_v_heads


def check_value_heads(beta: torch.Tensor, num_v_heads: int) -> None:
    """ValueError unless beta is [T, num_v_heads]."""
    if beta.dim() != 2 or beta.shape[1] != num_v_heads:
        raise ValueError(f"beta [T, {num_v_heads}] expected for {num_v_heads} value heads, got {tuple(beta.shape)}")
