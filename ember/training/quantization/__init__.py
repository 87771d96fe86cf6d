"""Quantizing trained models (``ember quantize``, post-training) and training them
quantization-aware (``quantize:`` in an LM config)."""
