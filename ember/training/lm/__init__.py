"""The language-model kind: config schema, the LM task (model, loss, data, samples) and its
entry point. ``ember train configs/lm/tiny.yaml`` runs it through ``ember.training.trainer``."""
