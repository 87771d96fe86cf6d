"""Linearising a pretrained softmax transformer (LoLCATs): attention transfer, then LoRA.

``ember linearize RUN_OR_HF_DIR OUT`` (``command``) or ``ember train`` with ``kind: linearize``
(``entry``); the config is ``config.LinearizeRunConfig``, the two trainer tasks are in ``tasks``.
"""
