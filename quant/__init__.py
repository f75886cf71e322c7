"""Weight quantization: the packed QuantizedWeight type, RTN, GPTQ, AWQ, and calibration.

Importing this package registers QuantizedWeight's product with ops.matmul.linear, so the model's
linear layers accept quantized kernels.
"""
from quant.qtensor import QuantizedWeight, dequantize  # noqa: F401  (registers the matmul)
