"""Quantizing trained models (``ember quantize``, post-training) and training them
quantization-aware (``qat:`` in an LM config)."""
