"""Fine-tuning pretrained LMs (``kind: finetune``): LoRA-family adapters or full fine-tuning
on JSONL examples, exported in PEFT format and as a merged Hugging Face checkpoint.

    ember train configs/finetune/lora.yaml base_model.path=path/to/hf_model data.train=train.jsonl
"""

from ember.training.finetune.config import FinetuneConfig
from ember.training.finetune.task import FinetuneTask

__all__ = ["FinetuneConfig", "FinetuneTask"]
