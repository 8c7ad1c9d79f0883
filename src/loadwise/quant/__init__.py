"""Quantization: simulated number formats (INT, MXFP4, NVFP4) for weights, activations and the
KV cache, the field's baselines (round-to-nearest, SmoothQuant, GPTQ, a QuaRot-style rotation)
and calibration-free DualQuant, scored by perplexity (``loadwise quant eval``)."""
