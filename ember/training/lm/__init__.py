"""The language-model trainer: config schema, pure train/eval steps, the training loop and
end-of-run sampling. ``ember train configs/lm/tiny.yaml`` runs it."""
