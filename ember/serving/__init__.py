"""Serving: the jitted engine, host-side scheduler, KV/state cache, sampling, export and
the batch-inference command (DESIGN.md section 7). Never imports ``ember.training``."""
