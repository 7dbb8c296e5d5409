"""Pallas GPU kernels (fused attention softmax, layer norm and RMSNorm, depthwise conv1d,
LM-head cross-entropy, causal flash attention and GELU in the MLP's GEMMs on Mosaic GPU) with
custom VJPs.

Each op is `<op>.py` (the public function: argument checks, the custom VJP, the choice of
lowering) above `<op>_triton.py` and `<op>_mgpu.py` (the Triton and Mosaic GPU kernels), which
share `common.py`, `rows_mgpu.py` (Mosaic GPU row-kernel blocks) and any `<op>_common.py`;
`reference.py` holds the jnp references. On a GPU the kernels compile; elsewhere
`interpret=None` runs the Triton ones in interpret mode.
"""

from .attention_softmax import attention_softmax
from .common import mosaic_gpu_refusal, triton_refusal
from .cross_entropy import head_chunk_rows, linear_cross_entropy, mosaic_loss_refusal
from .depthwise_conv1d import depthwise_conv1d
from .flash_attention import (
    faster_than_cudnn,
    flash_attention,
    flash_attention_qkv,
    flash_attention_qkv_grad,
    flash_attention_refusal,
)
from .layer_norm import add_layer_norm, add_rms_norm, layer_norm, mosaic_norm_refusal, rms_norm
from .matmul_gelu import matmul_dgelu, matmul_gelu, matmul_gelu_refusal
from .reference import (
    add_layer_norm_ref,
    add_rms_norm_ref,
    attention_softmax_ref,
    depthwise_conv1d_ref,
    flash_attention_ref,
    layer_norm_ref,
    linear_cross_entropy_ref,
    matmul_dgelu_ref,
    matmul_gelu_ref,
    rms_norm_ref,
)

__all__ = [
    "add_layer_norm",
    "add_layer_norm_ref",
    "add_rms_norm",
    "add_rms_norm_ref",
    "attention_softmax",
    "attention_softmax_ref",
    "depthwise_conv1d",
    "depthwise_conv1d_ref",
    "faster_than_cudnn",
    "flash_attention",
    "flash_attention_qkv",
    "flash_attention_qkv_grad",
    "flash_attention_refusal",
    "flash_attention_ref",
    "head_chunk_rows",
    "layer_norm",
    "layer_norm_ref",
    "linear_cross_entropy",
    "linear_cross_entropy_ref",
    "matmul_dgelu",
    "matmul_dgelu_ref",
    "matmul_gelu",
    "matmul_gelu_ref",
    "matmul_gelu_refusal",
    "mosaic_gpu_refusal",
    "mosaic_loss_refusal",
    "mosaic_norm_refusal",
    "rms_norm",
    "rms_norm_ref",
    "triton_refusal",
]
