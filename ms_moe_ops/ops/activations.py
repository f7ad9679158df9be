"""Host-side (numpy) maths of moe_ffn's contract, for code that prepares its inputs (int8
calibration): its activations as the kernels round them, and the device's dequant-scale
encoding. The golden models in reference.py keep their own copies: independent evidence."""
import numpy as np

__all__ = ["ffn_activation", "float_to_deq_scale"]


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # stable for any |x|


def ffn_activation(name, h):
    """moe_ffn's activation ("fastgelu", "gelu", "relu", "silu") of h, computed in float64 and
    rounded to float32 as the kernels round it."""
    h = np.asarray(h, np.float32).astype(np.float64)
    if name == "relu":
        out = np.maximum(h, 0)
    elif name == "fastgelu":
        out = h * _sigmoid(1.702 * h)
    elif name == "gelu":
        out = h * _sigmoid(1.59576912 * (h + 0.044715 * h ** 3))
    elif name == "silu":
        out = h * _sigmoid(h)
    else:
        raise ValueError(f"ffn_activation: name must be fastgelu, gelu, relu or silu, got {name!r}")
    return out.astype(np.float32)


def float_to_deq_scale(scale):
    """float32 dequant scales -> uint64 as the device takes them (low 32 bits = float32 bits)."""
    return np.asarray(scale, np.float32).view(np.uint32).astype(np.uint64)
