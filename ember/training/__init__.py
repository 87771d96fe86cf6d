"""Training: the ``ember train`` launcher, the task-generic trainer (``trainer``, ``task``,
``train_step``, ``trainable``), the LM task (``lm``), RL algorithms, optimizers, data and
metrics (DESIGN.md section 6)."""
