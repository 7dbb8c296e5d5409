"""The operands and kernel names both layer norm lowerings share (LayerNorm and RMSNorm, with
or without the fused residual add)."""


def operands(direction: str, residual: bool, rms: bool) -> tuple[str, ...]:
    """The kernels' operand names, inputs then outputs, in call order (both lowerings): h and s
    (ds and dh) only with the residual add; beta, mean (and dbeta) only for LayerNorm."""
    if direction == "fwd":
        names = ("x", residual and "h", "g", not rms and "b",
                 residual and "s", "y", not rms and "mean", "rstd")  # fmt: skip
    else:
        names = ("x", "g", "dy", residual and "ds", not rms and "mean", "rstd",
                 "dx", residual and "dh", "dg", not rms and "db")  # fmt: skip
    return tuple(n for n in names if n)


def kernel_name(direction: str, residual: bool, rms: bool) -> str:
    """e.g. add_rms_norm_fwd: the kernel's name in profiles (layer_norm_mgpu adds _mgpu)."""
    return f"{'add_' if residual else ''}{'rms' if rms else 'layer'}_norm_{direction}"
