"""Gated delta rule: `naive` (recurrent, float32 ground truth) and `chunk` (chunked, the CPU path)."""
from pixeltriage.kernels.gated_delta.chunk import chunk_gated_delta_rule, conv_chunk_gated_delta_rule, conv_heads
from pixeltriage.kernels.gated_delta.naive import recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "conv_chunk_gated_delta_rule", "conv_heads", "recurrent_gated_delta_rule"]
