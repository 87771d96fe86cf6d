"""A tiny fine-tuning problem built locally: a random Hugging Face Llama with its own word-level
tokenizer (``tokenizer.json`` + ``tokenizer_config.json``, as a real checkpoint directory has)
and JSONL files of an animal-sound task whose completions the random model cannot know."""

import json
from pathlib import Path

ANIMALS = {"cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "owl": "hoot",
           "bee": "buzz", "lion": "roar"}  # fmt: skip
WORDS = ["<unk>", "<s>", "</s>", "what", "does", "the", "say", "?", "a", "it", *ANIMALS, *ANIMALS.values()]
BOS, EOS = 1, 2


def write_tokenizer(path: Path, words: list[str] = WORDS) -> None:
    """A word-level tokenizer of ``words`` (which start as ``WORDS`` do) that prepends ``<s>``, as Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "model_max_length": 64}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_base_model(path: Path, *, seed: int = 0, experts: int = 0) -> Path:
    """A tiny random Llama and its tokenizer in ``path`` (nothing downloaded); with ``experts``,
    a Mixtral of that many experts (top-2, each 32 wide) alike in all else."""
    import transformers

    from tests.hf_peers import random_hf_model

    common = dict(
        vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None,
    )  # fmt: skip
    if experts:
        config = transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=experts)
    else:
        config = transformers.LlamaConfig(**common, intermediate_size=64)
    random_hf_model(config, seed=seed).save_pretrained(path)
    write_tokenizer(path)
    return path


def write_examples(path: Path, *, repeats: int = 4, chat: bool = False) -> Path:
    """JSONL of "what does the <animal> say ?" -> "<sound>" (prompt/completion or messages)."""
    lines = []
    for _ in range(repeats):
        for animal, sound in ANIMALS.items():
            prompt = f"what does the {animal} say ?"
            if chat:
                turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": sound}]
                lines.append({"messages": turns})
            else:
                lines.append({"prompt": prompt, "completion": f" {sound}"})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
