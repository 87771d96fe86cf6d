"""Training: the ``ember train`` launcher, the LM trainer, RL algorithms, optimizers, data
and metrics (DESIGN.md section 6)."""
