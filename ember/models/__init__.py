"""Flax Linen modules: layers (norm, rope, mlp, attention, moe, lora, ssm), assembled models
and Hugging Face import (DESIGN.md section 3)."""
