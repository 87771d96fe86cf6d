"""Vectorized, jit-compiled JAX RL environments with the gymnax 1.0 functional contract
(DESIGN.md section 5). Imports nothing from Ember but ``ember.core``."""
