"""``ember data prepare TEXT_FILES... --out DIR [--tokenizer HF_DIR]``: a user's text into
memory-mapped token files, with Ember's byte tokenizer or a Hugging Face model's own
(``tokenizer.json``), e.g. to linearise or fine-tune that model on the text."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from tqdm import tqdm

from ember.core.errors import PathNotFoundError
from ember.core.hf_tokenizer import load_hf_tokenizer
from ember.core.jsonl import readable
from ember.training.data.token_files import prepare_token_files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    prepare = sub.add_parser("prepare", help="tokenize text files into train.bin / val.bin / meta.json")
    prepare.add_argument("files", nargs="+", type=Path, help="UTF-8 text files; each is one document")
    prepare.add_argument("--out", type=Path, required=True, help="output dataset directory")
    prepare.add_argument(
        "--val-fraction",
        type=float,
        default=0.02,
        help="share of documents held out, chosen by a hash of each file's text",
    )
    prepare.add_argument(
        "--tokenizer", type=Path, default=None, help="a Hugging Face model directory whose tokenizer.json to use"
    )


def document_name(text: str) -> str:
    """The name a file's text goes by in the token files: a hash of the text, which chooses its
    split. The split of a file stays the same wherever the corpus lies, whatever other files are
    prepared with it, and copies of one text fall on the same side (none is both trained on and
    held out)."""
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def run(args: argparse.Namespace) -> int:
    missing = [str(path) for path in args.files if not readable(path)]  # files or pipes
    if missing:
        raise PathNotFoundError(f"not a file: {', '.join(missing)}")

    def documents():
        for path in tqdm(args.files, desc="tokenizing", unit="file"):
            text = path.read_text(encoding="utf-8", errors="replace")
            yield document_name(text), text

    tokenizer = load_hf_tokenizer(args.tokenizer) if args.tokenizer else None
    meta = prepare_token_files(documents(), args.out, val_fraction=args.val_fraction, tokenizer=tokenizer)
    for split, counts in meta["splits"].items():
        print(f"{split:<5} {counts['documents']:>8,} documents {counts['tokens']:>12,} tokens")
    if args.val_fraction > 0 and meta["splits"]["val"]["tokens"] == 0:  # held out by text hash: few files, none
        print(
            f"note: no document went to validation (--val-fraction {args.val_fraction} of "
            f"{meta['splits']['train']['documents']} documents, chosen by their text): "
            "training on it logs no val_loss; "
            "raise --val-fraction or prepare more files"
        )
    print(f"wrote {args.out}")
    return 0
