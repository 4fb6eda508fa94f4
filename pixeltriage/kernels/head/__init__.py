"""Decision head: gather rows, final norm, bilinear logits, p_vis / gains / relevance."""
from pixeltriage.kernels.head.reference import HeadOutput, decision_head_reference, final_norm_rows

__all__ = ["HeadOutput", "decision_head_reference", "final_norm_rows"]
