"""Pallas GPU kernels (fused attention softmax, layer norm and RMSNorm, depthwise conv1d,
LM-head cross-entropy) with custom VJPs.

On a GPU they compile (Triton lowering); elsewhere `interpret=None` runs them in interpret mode.
"""

from .attention_softmax import attention_softmax
from .cross_entropy import head_chunk_rows, linear_cross_entropy
from .depthwise_conv1d import depthwise_conv1d
from .layer_norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from .reference import (
    add_layer_norm_ref,
    add_rms_norm_ref,
    attention_softmax_ref,
    depthwise_conv1d_ref,
    layer_norm_ref,
    linear_cross_entropy_ref,
    rms_norm_ref,
)
from .triton_backend import mosaic_loss_refusal

__all__ = [
    "add_layer_norm",
    "add_layer_norm_ref",
    "add_rms_norm",
    "add_rms_norm_ref",
    "attention_softmax",
    "attention_softmax_ref",
    "depthwise_conv1d",
    "depthwise_conv1d_ref",
    "head_chunk_rows",
    "layer_norm",
    "layer_norm_ref",
    "linear_cross_entropy",
    "linear_cross_entropy_ref",
    "mosaic_loss_refusal",
    "rms_norm",
    "rms_norm_ref",
]
