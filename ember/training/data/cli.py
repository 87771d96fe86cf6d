"""``ember data prepare TEXT_FILES... --out DIR [--tokenizer HF_DIR]``: a user's text into
memory-mapped token files, with Ember's byte tokenizer or a Hugging Face model's own
(``tokenizer.json``), e.g. to linearise or fine-tune that model on the text.

``ember data cache [list]`` lists the built-in corpora prepared in Ember's cache (``--cache-dir``,
else ``$EMBER_CACHE``, else ``~/.cache/ember``), and ``ember data cache prune [--dry-run] [--all]``
deletes those this Ember no longer reads (``--all``: every one; each is prepared again on its next
use). What is stale and what is left alone is decided in ``ember.training.data.cache_scan``."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import time
from pathlib import Path

from tqdm import tqdm

from ember.core.byte_sizes import format_bytes
from ember.core.cache_dir import ember_cache_dir
from ember.core.errors import PathNotFoundError
from ember.core.hf_tokenizer import load_hf_tokenizer
from ember.core.jsonl import readable
from ember.training.data.cache_scan import IN_PROGRESS_MINUTES, CachedCorpus, prune, scan_corpora
from ember.training.data.corpus_cache import CORPORA_DIR
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
    # --cache-dir on each level, so it may stand before or after list/prune; SUPPRESS keeps a
    # sub-command's absent option from overwriting the one given before it.
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--cache-dir",
        type=Path,
        default=argparse.SUPPRESS,
        help="Ember's cache (default: $EMBER_CACHE or ~/.cache/ember)",
    )
    cache = sub.add_parser("cache", parents=[where], help="list the prepared built-in corpora (or: cache prune)")
    cache_sub = cache.add_subparsers(dest="cache_action")
    cache_sub.add_parser("list", parents=[where], help="one line per prepared corpus: size, preparation, status")
    prune_parser = cache_sub.add_parser(
        "prune",
        parents=[where],
        help=f"delete the stale corpora (any changed in the last {IN_PROGRESS_MINUTES} minutes is left)",
    )
    prune_parser.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    prune_parser.add_argument(
        "--all", action="store_true", dest="everything", help="delete every corpus (prepared again on next use)"
    )


def document_name(text: str) -> str:
    """The name a file's text goes by in the token files: a hash of the text, which chooses its
    split. The split of a file stays the same wherever the corpus lies, whatever other files are
    prepared with it, and copies of one text fall on the same side (none is both trained on and
    held out)."""
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def run(args: argparse.Namespace) -> int:
    if args.action == "cache":
        cache = ember_cache_dir(getattr(args, "cache_dir", None))  # absent: no --cache-dir at any level
        return prune_cache(cache, args.everything, args.dry_run) if args.cache_action == "prune" else list_cache(cache)
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


def list_cache(cache: Path) -> int:
    """``ember data cache``: a table of the corpora prepared in ``cache``, then the total and what
    prune would free."""
    corpora, now = scan_corpora(cache), time.time()
    if not corpora:
        print(f"no prepared corpora in {cache / CORPORA_DIR}")
        return 0
    header = ("name", "size", "format", "tokenizer", "modified", "status")
    rows = [header] + [_row(corpus, now) for corpus in corpora]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header) - 1)]
    print(cache / CORPORA_DIR)
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    total, stale = sum(c.size for c in corpora), sum(c.reclaimable() for c in corpora)
    print(
        f"total {format_bytes(total)} in {len(corpora)} director{'y' if len(corpora) == 1 else 'ies'}; "
        f"stale {format_bytes(stale)} ('ember data cache prune' deletes it)"
    )
    return 0


def prune_cache(cache: Path, everything: bool, dry_run: bool) -> int:
    """``ember data cache prune``: deletes (``dry_run``: names) what is stale in ``cache``, or
    ``everything``, and says what it leaves and why."""
    pruned, left = prune(scan_corpora(cache), everything=everything, dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    for corpus, freed in pruned:
        if corpus.stale or everything:
            why = corpus.stale or "current, prepared again on its next use"
            print(f"{verb} {corpus.path.name} ({format_bytes(freed)}): {why}")
        else:
            count = len(corpus.temporary)
            print(
                f"{verb} {count} leftover temporary file{'s' if count > 1 else ''} of {corpus.path.name} "
                f"({format_bytes(freed)})"
            )
    for corpus in left:
        print(
            f"left {corpus.path.name}: modified {_ago(corpus.modified, time.time())}, a preparation may be writing "
            f"it (a corpus changed in the last {IN_PROGRESS_MINUTES} minutes is left; prune again later)"
        )
    freed = sum(size for _, size in pruned)
    if not pruned and not left:
        print(f"nothing to delete in {cache / CORPORA_DIR}")
    elif dry_run:
        print(f"would free {format_bytes(freed)} (dry run: nothing deleted)")
    else:
        print(f"freed {format_bytes(freed)}")
    return 0


def _row(corpus: CachedCorpus, now: float) -> tuple[str, ...]:
    """The cells of ``corpus``'s line in the listing."""
    meta = corpus.meta or {}
    status = f"stale: {corpus.stale}" if corpus.stale else "current"
    if corpus.temporary and not corpus.stale:
        status += f", {len(corpus.temporary)} leftover temporary file(s) ({format_bytes(corpus.temporary_size)})"
    if corpus.to_delete() and corpus.in_progress(now):
        status += f"; modified {_ago(corpus.modified, now)}: may be being prepared, prune leaves it"
    modified = datetime.datetime.fromtimestamp(corpus.modified).strftime("%Y-%m-%d %H:%M")
    return (
        corpus.path.name,
        format_bytes(corpus.size),
        str(meta.get("format", "-")),
        _tokenizer_label(meta.get("tokenizer")),
        modified,
        status,
    )


def _tokenizer_label(description: object) -> str:
    """A tokenizer description (``describe()``) in a few characters: ``bytes``, or ``hf`` with the
    tokenizer's class and a digest of its ``tokenizer.json`` (two models' tokenizers differ there)."""
    if not isinstance(description, dict):
        return "-"
    if description.get("type") != "hf":
        return str(description.get("type", "-"))
    digest = hashlib.sha256(str(description.get("tokenizer_json", "")).encode()).hexdigest()[:8]
    config = description.get("config")
    kind = config.get("tokenizer_class") if isinstance(config, dict) else None
    return " ".join(str(part) for part in ("hf", kind, digest) if part)


def _ago(then: float, now: float) -> str:
    """``then`` as the whole minutes before ``now`` (``'0 min ago'`` under a minute)."""
    return f"{max(0, int((now - then) // 60))} min ago"
