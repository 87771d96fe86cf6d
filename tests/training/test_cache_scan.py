"""The built-in corpora's cache: ``scan_corpora`` classifies, ``prune`` deletes, ``ember data cache``
lists and prunes. Every directory here is made by Ember's own writers (``cached_corpus``,
``prepare_token_files`` stopped mid-way), not spelled by hand, but for the meta.json of another
format."""

import hashlib
import json
import os
import re
import subprocess
import sys
import time

import pytest

from ember.cli import main
from ember.core.byte_sizes import format_bytes
from ember.training.data import TokenDataset, cache_scan, corpus_cache, prepare_token_files
from ember.training.data.cache_scan import IN_PROGRESS_MINUTES, prune, scan_corpora
from ember.training.data.corpus_cache import cached_corpus
from ember.training.data.token_files import PREPARATION_FORMAT

DOCUMENTS = [("a.py", "x = 1\n"), ("b.py", "def f():\n    return 2\n"), ("c.py", "y = [3] * 4\n")]
HOUR_AGO = int(time.time()) - 3600  # whole seconds: any file system keeps them


class Stop(Exception):
    """What stops a preparation mid-way here (a process killed while it writes)."""


def interrupted(directory, after=1):
    """Stops ``prepare_token_files`` into ``directory`` after ``after`` documents: its temporary
    files stay, nothing is renamed into place."""

    def documents():
        yield from DOCUMENTS[:after]
        raise Stop

    with pytest.raises(Stop):
        prepare_token_files(documents(), directory, val_fraction=0.0)


def other_format(directory, format_):
    """A corpus another Ember prepared: its meta.json records ``format_`` (``None``: none)."""
    prepare_token_files(DOCUMENTS, directory, val_fraction=0.0)
    meta = json.loads((directory / "meta.json").read_text())
    meta.pop("format")
    (directory / "meta.json").write_text(json.dumps(meta if format_ is None else {**meta, "format": format_}))


def age(directory, when=HOUR_AGO):
    """Sets the modification time of ``directory`` and of everything in it to ``when``."""
    for path in [directory, *directory.iterdir()]:
        os.utime(path, (when, when))


def refuse_to_prepare(*args, **kwargs):
    raise AssertionError("a cached corpus was prepared again")


def files_of(root):
    """``{relative path: bytes}`` of every file under ``root``."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def cache(tmp_path):
    """A cache holding one corpus of each kind, all last written an hour ago:

    current     prepared by this Ember (cached_corpus)
    leftover    current, with the temporary files of a second preparer that died beside it
    older       another format (one before the format was recorded: none)
    newer       a later Ember's format
    torn        a preparation stopped before any rename (no meta.json)
    .gone...    a prune stopped between its rename and its removal (a current meta.json still in it)
    """
    current = cached_corpus("current", lambda: DOCUMENTS, cache_dir=tmp_path)
    leftover = cached_corpus("leftover", lambda: DOCUMENTS[:2], cache_dir=tmp_path)
    interrupted(leftover)
    corpora = tmp_path / "corpora"
    other_format(corpora / "older", None)
    other_format(corpora / "newer", PREPARATION_FORMAT + 1)
    interrupted(corpora / "torn", after=2)
    deleting = cached_corpus("gone", lambda: DOCUMENTS, cache_dir=tmp_path)
    deleting.rename(corpora / f".{deleting.name}.123-ab12cd34{cache_scan.DELETING_SUFFIX}")
    (corpora / "notes.txt").write_text("not a corpus")  # a file: not listed, never deleted
    for directory in corpora.iterdir():
        if directory.is_dir():
            age(directory)
    return {"root": tmp_path, "current": current.name, "leftover": leftover.name}


def test_scan_tells_current_from_stale_interrupted_and_leftover_files(cache):
    corpora = {corpus.path.name: corpus for corpus in scan_corpora(cache["root"])}
    gone = next(name for name in corpora if name.startswith(".gone-"))
    assert {name: corpus.stale for name, corpus in corpora.items()} == {
        cache["current"]: None,
        cache["leftover"]: None,
        "older": "another Ember's preparation (no format)",
        "newer": f"another Ember's preparation (format {PREPARATION_FORMAT + 1})",
        "torn": "an interrupted preparation (no readable meta.json)",
        gone: "a deletion interrupted",
    }
    for name, corpus in corpora.items():
        files = list(corpus.path.iterdir())
        assert corpus.size == sum(p.stat().st_size for p in files) > 0 and corpus.modified == HOUR_AGO
        temporary = sorted(p for p in files if p.name.endswith(".partial"))
        assert corpus.temporary == tuple(temporary)
        assert corpus.temporary_size == sum(p.stat().st_size for p in temporary)
        # The writers' own temporary names: those of an interrupted preparation, none in a finished one.
        assert bool(temporary) == (name in (cache["leftover"], "torn"))
    assert corpora["torn"].meta is None and corpora[cache["current"]].meta["format"] == PREPARATION_FORMAT
    assert [p.name.split(".")[1] for p in corpora[cache["leftover"]].temporary] == ["train", "val"]
    # What the scan calls current is what cached_corpus reuses without preparing.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(corpus_cache, "prepare_token_files", refuse_to_prepare)
        assert cached_corpus("current", lambda: DOCUMENTS, cache_dir=cache["root"]).name == cache["current"]
    assert scan_corpora(cache["root"] / "nothing here") == []


def test_prune_deletes_only_what_is_stale_and_dry_run_nothing(cache):
    root, corpora = cache["root"], cache["root"] / "corpora"
    before = files_of(corpora)
    planned, left = prune(scan_corpora(root), dry_run=True)
    assert files_of(corpora) == before and left == []
    pruned, left = prune(scan_corpora(root))
    assert left == [] and [(c.path.name, freed) for c, freed in pruned] == [(c.path.name, f) for c, f in planned]
    stale = [name for name in before if not name.startswith((cache["current"], cache["leftover"], "notes"))]
    leftover = [name for name in before if name.startswith(cache["leftover"] + "/.")]
    assert len(leftover) == 2 and sum(freed for _, freed in pruned) == sum(len(before[n]) for n in stale + leftover)
    assert files_of(corpora) == {name: data for name, data in before.items() if name not in stale + leftover}
    assert sorted(p.name for p in corpora.iterdir()) == sorted([cache["current"], cache["leftover"], "notes.txt"])
    with pytest.MonkeyPatch.context() as patch:  # both are still reused as they are
        patch.setattr(corpus_cache, "prepare_token_files", refuse_to_prepare)
        cached_corpus("current", lambda: DOCUMENTS, cache_dir=root)
        cached_corpus("leftover", lambda: DOCUMENTS[:2], cache_dir=root)
    assert prune(scan_corpora(root)) == ([], [])


def test_prune_all_deletes_every_corpus_and_the_next_use_prepares_it_again(cache):
    root, corpora = cache["root"], cache["root"] / "corpora"
    sizes = {corpus.path.name: corpus.size for corpus in scan_corpora(root)}
    pruned, left = prune(scan_corpora(root), everything=True)
    assert left == [] and {c.path.name: freed for c, freed in pruned} == sizes
    assert [p.name for p in corpora.iterdir()] == ["notes.txt"]
    assert cached_corpus("current", lambda: DOCUMENTS, cache_dir=root).name == cache["current"]
    assert [corpus.stale for corpus in scan_corpora(root)] == [None]


def test_a_corpus_changed_in_the_last_minutes_is_left_even_by_all(cache):
    """A stale corpus that this Ember is preparing again in place (its meta.json records another
    format): the prune that runs mid-preparation, after the first document, leaves it, and the
    preparation ends whole. Its temporary files are what makes it recent: the directory was last
    written an hour ago."""
    root, corpora = cache["root"], cache["root"] / "corpora"
    recipe = json.loads((corpora / cache["current"] / "meta.json").read_text())
    (corpora / cache["current"] / "meta.json").write_text(json.dumps({**recipe, "format": PREPARATION_FORMAT - 1}))
    age(corpora / cache["current"])
    outcomes = []

    def documents():
        yield DOCUMENTS[0]
        outcomes.append(prune(scan_corpora(root), everything=True))
        yield from DOCUMENTS[1:]

    others = sorted(p.name for p in corpora.iterdir() if p.is_dir() and p.name != cache["current"])
    assert cached_corpus("current", documents, cache_dir=root).name == cache["current"]
    [(pruned, left)] = outcomes
    assert [corpus.path.name for corpus in left] == [cache["current"]]
    assert sorted(corpus.path.name for corpus, _ in pruned) == others and len(others) == 5
    assert sorted(p.name for p in corpora.iterdir()) == [cache["current"], "notes.txt"]
    [corpus] = scan_corpora(root)
    splits = TokenDataset.open(corpus.path).meta["splits"].values()
    assert corpus.stale is None and corpus.temporary == ()
    assert sum(split["tokens"] for split in splits) == sum(len(text.encode()) + 1 for _, text in DOCUMENTS)
    # The boundary: modified IN_PROGRESS_MINUTES ago and a second less is left, a second more is not.
    interrupted(corpora / "torn")
    age(corpora / "torn")
    limit = HOUR_AGO + IN_PROGRESS_MINUTES * 60
    assert [c.path.name for c in prune(scan_corpora(root), now=limit - 1)[1]] == ["torn"]
    assert [c.path.name for c, _ in prune(scan_corpora(root), now=limit + 1)[0]] == ["torn"]
    assert not (corpora / "torn").exists()


def test_cli_lists_and_prunes_the_cache(cache, monkeypatch, capsys):
    root = cache["root"]
    monkeypatch.setenv("EMBER_CACHE", str(root))
    hf = {"type": "hf", "tokenizer_json": '{"model": {}}', "config": {"tokenizer_class": "LlamaTokenizer"}}
    meta = json.loads((root / "corpora" / "newer" / "meta.json").read_text())
    (root / "corpora" / "newer" / "meta.json").write_text(json.dumps({**meta, "tokenizer": hf}))
    os.utime(root / "corpora" / "newer" / "meta.json", (HOUR_AGO, HOUR_AGO))
    corpora = {corpus.path.name: corpus for corpus in scan_corpora(root)}
    assert main(["data", "cache"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0] == str(root / "corpora") and listing[1].split() == [
        "name", "size", "format", "tokenizer", "modified", "status"
    ]  # fmt: skip
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line) for line in listing[2:-1])}
    assert sorted(rows) == sorted(corpora) and len(listing) == len(corpora) + 3
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(HOUR_AGO))
    digest = hashlib.sha256(hf["tokenizer_json"].encode()).hexdigest()[:8]

    def row(name, *cells):
        return [format_bytes(corpora[name].size), *cells[:2], when, cells[2]]

    assert rows["newer"] == row(
        "newer",
        str(PREPARATION_FORMAT + 1),
        f"hf LlamaTokenizer {digest}",
        f"stale: another Ember's preparation (format {PREPARATION_FORMAT + 1})",
    )
    assert rows[cache["current"]] == row(cache["current"], str(PREPARATION_FORMAT), "bytes", "current")
    assert rows["older"] == row("older", "-", "bytes", "stale: another Ember's preparation (no format)")
    assert rows["torn"] == row("torn", "-", "-", "stale: an interrupted preparation (no readable meta.json)")
    temporary = format_bytes(corpora[cache["leftover"]].temporary_size)
    assert rows[cache["leftover"]] == row(
        cache["leftover"], str(PREPARATION_FORMAT), "bytes", f"current, 2 leftover temporary file(s) ({temporary})"
    )
    stale = sum(corpus.size for corpus in corpora.values() if corpus.stale) + corpora[cache["leftover"]].temporary_size
    total = sum(corpus.size for corpus in corpora.values())
    assert listing[-1] == (
        f"total {format_bytes(total)} in 6 directories; "
        f"stale {format_bytes(stale)} ('ember data cache prune' deletes it)"
    )
    assert main(["data", "cache", "list"]) == 0 and capsys.readouterr().out.splitlines() == listing

    before = files_of(root)
    assert main(["data", "cache", "prune", "--dry-run"]) == 0
    dry = capsys.readouterr().out.splitlines()
    assert files_of(root) == before
    assert "would delete torn (" in "\n".join(dry) and dry[-1].endswith("(dry run: nothing deleted)")
    monkeypatch.setenv("EMBER_CACHE", str(root / "elsewhere"))  # --cache-dir wins, before or after prune
    assert main(["data", "cache", "--cache-dir", str(root), "prune"]) == 0
    done = capsys.readouterr().out.splitlines()
    assert [line.replace("would delete", "deleted") for line in dry[:-1]] == done[:-1]
    assert f"deleted 2 leftover temporary files of {cache['leftover']} (" in "\n".join(done)
    assert done[-1] == f"freed {format_bytes(stale)}"
    assert sorted(c.path.name for c in scan_corpora(root)) == sorted([cache["current"], cache["leftover"]])
    assert main(["data", "cache", "prune", "--cache-dir", str(root)]) == 0
    assert capsys.readouterr().out == f"nothing to delete in {root / 'corpora'}\n"
    # A corpus being prepared is named with the rule; --all takes the rest.
    interrupted(root / "corpora" / "busy")
    assert main(["data", "cache", "prune", "--all", "--cache-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"deleted {cache['current']} (" in out and "): current, prepared again on its next use\n" in out
    assert "left busy: modified 0 min ago, a preparation may be writing it (a corpus changed in the last " in out
    assert [c.path.name for c in scan_corpora(root)] == ["busy"]


def test_listing_the_cache_does_not_import_jax(cache):
    """A look at a few directories starts in a fraction of a second: the byte sizes came from
    ember.core.tree, which imports flax and JAX (2 s on a 2-core machine)."""
    code = (
        "import sys; from ember.cli import main\n"
        f"assert main(['data', 'cache', '--cache-dir', {str(cache['root'])!r}]) == 0\n"
        "print('jax' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = result.stdout.splitlines()
    assert lines[-1] == "False" and lines[0] == str(cache["root"] / "corpora") and len(lines) == 6 + 4, result.stderr
