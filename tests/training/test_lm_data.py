"""LM data: byte tokenizer, token files, packing with segment ids, the resumable iterator."""

import itertools
import json
import platform

import numpy as np
import pytest

from ember.cli import main
from ember.core.errors import ConfigError, DataError
from ember.core.hf_tokenizer import load_hf_tokenizer
from ember.core.tokenizer import ByteTokenizer, tokenizer_from_description
from ember.training.data import (
    PackedBatches,
    TokenDataset,
    corpus,
    corpus_cache,
    pack_window,
    prepare_token_files,
    stdlib_corpus_dir,
    stdlib_documents,
    token_files,
)
from ember.training.data.arithmetic import arithmetic_corpus_dir, arithmetic_problems, split_problems
from ember.training.data.token_files import PREPARATION_FORMAT, validation_split
from ember.training.lm.task import LMTask
from tests.pipes import pipe_holding
from tests.training.lm_runs import small_config

EOS = ByteTokenizer.eos_id


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "def f(x):\n    return 'héllo, 世界'\n"
    ids = tokenizer.encode(text, add_eos=True)
    assert ids.dtype == np.uint16 and ids[-1] == EOS and len(ids) == len(text.encode("utf-8")) + 1
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([104, 105, EOS, 300]) == "hi"
    assert tokenizer.decode([0xE4, 0xB8]) == "\ufffd"  # truncated UTF-8 is replaced, not an exception
    assert isinstance(tokenizer_from_description(tokenizer.describe()), ByteTokenizer)
    with pytest.raises(ValueError, match="unknown tokenizer type 'bpe'"):
        tokenizer_from_description({"type": "bpe"})


def test_pack_window_by_hand():
    # documents "ab|", "c|", "de..." where | is EOS; seq_len 6
    window = np.array([97, 98, EOS, 99, EOS, 100, 101])
    row = pack_window(window, EOS)
    np.testing.assert_array_equal(row["tokens"], [97, 98, EOS, 99, EOS, 100])
    np.testing.assert_array_equal(row["targets"], [98, EOS, 99, EOS, 100, 101])
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 2, 2, 3])
    np.testing.assert_array_equal(row["positions"], [0, 1, 2, 0, 1, 0])
    np.testing.assert_array_equal(row["loss_mask"], [1, 1, 0, 1, 0, 1])
    with pytest.raises(ValueError, match="at least 2 tokens"):
        pack_window(np.array([1]), EOS)


def make_documents(n, seed=0):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "λ", "\n", "    ", "def", "return"]
    return [(f"doc{i:03d}.txt", " ".join(rng.choice(words, size=rng.integers(5, 40)))) for i in range(n)]


def test_prepare_and_open(tmp_path):
    documents = make_documents(60)
    meta = prepare_token_files(documents, tmp_path / "ds", val_fraction=0.2)
    data = TokenDataset.open(tmp_path / "ds")
    val_names = [name for name, _ in documents if validation_split(name, 0.2)]
    assert 0 < len(val_names) < 60
    assert meta["splits"]["val"]["documents"] == len(val_names)
    expected_train = np.concatenate(
        [ByteTokenizer().encode(t, add_eos=True) for n, t in documents if n not in val_names]
    )
    np.testing.assert_array_equal(np.asarray(data.train), expected_train)
    assert data.meta == json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert data.meta["format"] == PREPARATION_FORMAT
    assert not list((tmp_path / "ds").glob(".*partial"))
    # The split of a document depends on its name only, not on what else is in the corpus.
    meta_subset = prepare_token_files(documents[:30], tmp_path / "ds2", val_fraction=0.2)
    assert meta_subset["splits"]["val"]["documents"] == len([n for n in val_names if int(n[3:6]) < 30])


class WideTokenizer:
    """A vocabulary of 152,000 ids (Qwen2's size): ids past uint16."""

    vocab_size = 152_000
    eos_id = vocab_size - 1

    def encode(self, text, *, add_eos=False):
        return np.array([100_000 + ord(c) for c in text] + [self.eos_id] * add_eos, np.int64)

    def describe(self):
        return {"type": "wide"}


def test_a_vocabulary_past_uint16_is_stored_as_uint32(tmp_path):
    """Token files held uint16 only: a Llama-3 or Qwen2 tokenizer's text could not be prepared."""
    documents = make_documents(6)
    meta = prepare_token_files(documents, tmp_path / "wide", val_fraction=0.0, tokenizer=WideTokenizer())
    assert meta["token_dtype"] == "uint32"
    data = TokenDataset.open(tmp_path / "wide")
    expected = np.concatenate([WideTokenizer().encode(text, add_eos=True) for _, text in documents])
    np.testing.assert_array_equal(np.asarray(data.train), expected)
    # A byte dataset keeps uint16; one written before token_dtype was recorded reads as uint16.
    prepare_token_files(documents, tmp_path / "bytes", val_fraction=0.0)
    meta_file = tmp_path / "bytes" / "meta.json"
    old = {key: value for key, value in json.loads(meta_file.read_text()).items() if key != "token_dtype"}
    meta_file.write_text(json.dumps(old))
    assert TokenDataset.open(tmp_path / "bytes").train.dtype == np.uint16
    meta_file.write_text(json.dumps({**old, "token_dtype": "float32"}))
    with pytest.raises(DataError, match="token_dtype float32 is not one of uint16, uint32"):
        TokenDataset.open(tmp_path / "bytes")


def test_two_preparations_of_one_directory_at_once_both_finish(tmp_path):
    """Processes of one run prepare a cold shared cache (the stdlib corpus) at the same time.
    They wrote the same temporary names: the first renamed the second's file away, which then
    failed with FileNotFoundError. Here the second preparation runs inside the first's."""
    documents = [(f"doc{i}.py", f"print({i})\n" * 50) for i in range(40)]

    def with_another_preparation():
        for index, document in enumerate(documents):
            if index == 20:
                prepare_token_files(iter(documents), tmp_path, val_fraction=0.1)
            yield document

    prepare_token_files(with_another_preparation(), tmp_path, val_fraction=0.1)
    dataset = TokenDataset.open(tmp_path)
    expected = np.concatenate([ByteTokenizer().encode(t, add_eos=True) for n, t in documents
                               if not validation_split(n, 0.1)])  # fmt: skip
    np.testing.assert_array_equal(np.asarray(dataset.train), expected)
    assert not list(tmp_path.glob("*.partial"))


def test_open_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"not a prepared dataset .* 'ember data prepare"):
        TokenDataset.open(tmp_path)
    prepare_token_files(make_documents(10), tmp_path / "ds", val_fraction=0.0)
    with open(tmp_path / "ds" / "train.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match=r"train.bin holds .* tokens but meta.json says"):
        TokenDataset.open(tmp_path / "ds")
    with pytest.raises(ValueError, match="no text to prepare"):
        prepare_token_files([("a", "")], tmp_path / "empty")
    # Before, JSONDecodeError / KeyError tracebacks from 'ember train' (data.dataset=DIR).
    for meta in ('{"splits": {"train": ', '{"splits": {"train": {"tokens": 3}}}', "[]"):
        (tmp_path / "ds" / "meta.json").write_text(meta)
        with pytest.raises(DataError, match="is not the metadata 'ember data prepare' writes"):
            TokenDataset.open(tmp_path / "ds")


def test_a_truncated_token_file_is_a_data_error_naming_it(tmp_path):
    # Before, np.memmap's bare ValueError ("cannot mmap an empty file", "Size of available data
    # is not a multiple of the data-type size") escaped as a traceback from 'ember train'.
    prepare_token_files(make_documents(10), tmp_path, val_fraction=0.0)
    whole = (tmp_path / "train.bin").read_bytes()
    for damaged, held in ((b"", "0 tokens"), (whole[:-1], f"{len(whole) // 2 - 1} tokens and 1 byte")):
        (tmp_path / "train.bin").write_bytes(damaged)
        with pytest.raises(DataError, match=f"train.bin holds {held}.* but meta.json says {len(whole) // 2}"):
            TokenDataset.open(tmp_path)
    (tmp_path / "train.bin").unlink()  # a FileNotFoundError traceback before
    with pytest.raises(DataError, match=f"train.bin holds 0 tokens but meta.json says {len(whole) // 2}"):
        TokenDataset.open(tmp_path)


def test_a_tokenizer_without_an_end_of_document_id_is_refused(tmp_path):
    # Before, an HF tokenizer whose directory names no eos_token wrote the documents back to back
    # ("hello world" + "world" -> [1, 2, 2]): no boundary for packing's segments to split at.
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "tokenizer.json"))
    documents = [("a", "hello world"), ("b", "world")]
    with pytest.raises(DataError, match="no end-of-document id"):
        prepare_token_files(documents, tmp_path / "ds", val_fraction=0.0, tokenizer=load_hf_tokenizer(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    prepare_token_files(documents, tmp_path / "ds", val_fraction=0.0, tokenizer=load_hf_tokenizer(tmp_path))
    np.testing.assert_array_equal(np.asarray(TokenDataset.open(tmp_path / "ds").train), [1, 2, 3, 2, 3])


def stream_of(n_tokens, seed=1):
    stream = np.random.default_rng(seed).integers(0, 256, size=n_tokens).astype(np.uint16)
    stream[np.random.default_rng(seed + 1).choice(n_tokens, size=n_tokens // 20, replace=False)] = EOS
    return stream


def test_iterator_visits_every_window_once_per_epoch():
    stream = stream_of(1 + 8 * 25)  # exactly 25 windows of seq_len 8
    batches = PackedBatches(stream, seq_len=8, global_batch=5, seed=3)
    assert batches.num_windows == 25
    epoch = np.concatenate([batches.next()["tokens"] for _ in range(5)])
    starts = sorted(
        int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(stream[:-1], 8) == row, axis=1))[0])
        for row in epoch
    )
    assert starts == [8 * i for i in range(25)]
    second_epoch = np.concatenate([batches.next()["tokens"] for _ in range(5)])
    assert not np.array_equal(epoch, second_epoch)  # a new permutation each epoch


def test_iterator_resume_is_exact():
    stream = stream_of(5000)
    uninterrupted = PackedBatches(stream, seq_len=16, global_batch=8, seed=7)
    expected = [uninterrupted.next() for _ in range(60)]  # crosses several epoch boundaries
    first = PackedBatches(stream, seq_len=16, global_batch=8, seed=7)
    for _ in range(23):
        first.next()
    saved = json.loads(json.dumps(first.state()))
    resumed = PackedBatches(stream, seq_len=16, global_batch=8, seed=7)
    resumed.restore(saved)
    for step in range(23, 60):
        got = resumed.next()
        for key in got:
            np.testing.assert_array_equal(got[key], expected[step][key])
    with pytest.raises(ValueError, match="saved seq_len=16 but now 32"):
        PackedBatches(stream, seq_len=32, global_batch=8, seed=7).restore(saved)


def test_a_negative_data_seed_is_a_config_error_not_a_crash_at_the_first_batch():
    """NumPy's default_rng([seed, epoch]) refuses a negative seed: the iterator raised ValueError
    ('expected non-negative integer') at the first batch, after compiling."""
    from ember.core.config import load_config
    from ember.core.errors import ConfigError
    from ember.training.lm.config import LMConfig

    with pytest.raises(ConfigError, match=r"data\.seed must be a non-negative integer, got -1") as error:
        load_config(LMConfig, None, ["data.seed=-1"])
    assert error.value.key == "data.seed"


def test_evaluation_pass_counts_every_window_once():
    stream = stream_of(1 + 8 * 11)  # 11 windows: two global batches of 8, the second padded
    whole = PackedBatches(stream, seq_len=8, global_batch=8, shuffle=False)
    batches = list(whole.epoch(max_batches=5))
    assert len(batches) == 2
    rows = {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}
    for i in range(11):  # each window once, in order
        for key, value in pack_window(stream[8 * i : 8 * i + 9], EOS).items():
            np.testing.assert_array_equal(rows[key][i], value)
    assert not rows["loss_mask"][11:].any()  # then padding, which has no loss
    assert len(list(whole.epoch(max_batches=1))) == 1
    parts = [
        PackedBatches(stream, seq_len=8, global_batch=8, shuffle=False, process_index=i, process_count=2)
        for i in range(2)
    ]
    for got in zip(*(list(p.epoch()) for p in parts), batches):
        for key in got[-1]:
            np.testing.assert_array_equal(np.concatenate([g[key] for g in got[:-1]]), got[-1][key])


def test_lm_validation_reads_a_small_validation_split_once(tmp_path):
    prepare_token_files(make_documents(60), tmp_path / "ds", val_fraction=0.2)
    task = LMTask(small_config(tmp_path, tmp_path / "ds", "train.eval_batches=50"))  # 8 rows x 32 tokens
    windows = (len(task.dataset.val) - 1) // 32
    assert 8 < windows < 50 * 8
    rows = np.concatenate([batch["tokens"] for batch in task.eval_data()])
    assert len(rows) == -(-windows // 8) * 8
    expected = PackedBatches(task.dataset.val, seq_len=32, global_batch=windows, shuffle=False).next()["tokens"]
    np.testing.assert_array_equal(rows[:windows], expected)


def test_processes_read_disjoint_rows_of_the_same_global_batch():
    stream = stream_of(4000)
    whole = PackedBatches(stream, seq_len=16, global_batch=8, seed=2)
    parts = [
        PackedBatches(stream, seq_len=16, global_batch=8, seed=2, process_index=i, process_count=4) for i in range(4)
    ]
    for _ in range(3):
        expected = whole.next()
        got = [p.next() for p in parts]
        for key in expected:
            np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), expected[key])
    with pytest.raises(ValueError, match="not divisible by the 3 processes"):
        PackedBatches(stream, seq_len=16, global_batch=8, process_count=3)


def test_a_batch_the_processes_cannot_share_names_its_config_key():
    """The error named the iterator's own argument (global_batch) and no config key: a user
    could not tell which setting to change. It now names train.batch_size (or the key the
    caller gives), keys the ConfigError by it and says what is allowed."""
    stream = np.arange(200, dtype=np.int32)
    with pytest.raises(ConfigError) as error:
        PackedBatches(stream, seq_len=16, global_batch=8, process_count=3)
    assert str(error.value) == (
        "train.batch_size (8) is not divisible by the 3 processes: each process reads an equal share of every "
        "global batch, so train.batch_size must be a multiple of 3"
    )
    assert error.value.key == "train.batch_size"
    with pytest.raises(ConfigError, match=r"^transfer\.train\.batch_size \(6\) is not divisible by the 4") as error:
        PackedBatches(stream, seq_len=16, global_batch=6, process_count=4, batch_key="transfer.train.batch_size")
    assert error.value.key == "transfer.train.batch_size"


def test_stdlib_corpus_is_real_sorted_python():
    documents = list(itertools.islice(stdlib_documents(), 40))
    names = [name for name, _ in documents]
    assert names == sorted(names) and len(set(names)) == 40
    assert sum("import" in text or "def " in text for _, text in documents) > 20


def texts_in(directory):
    """The documents of a prepared byte-tokenized dataset, train split then validation."""
    data, texts = TokenDataset.open(directory), []
    for ids in (np.asarray(data.train), np.asarray(data.val)):
        texts += [ByteTokenizer().decode(doc) for doc in np.split(ids, np.flatnonzero(ids == EOS) + 1)[:-1]]
    return texts


def stale_preparation(directory, format_=None):
    """What another Ember left in ``directory``: other documents, and meta.json recording
    preparation format ``format_`` (``None``: no format, as before it was recorded)."""
    prepare_token_files([("stale.py", "stale = True\n")], directory, val_fraction=0.0)
    meta = json.loads((directory / "meta.json").read_text())
    meta.pop("format", None)
    (directory / "meta.json").write_text(json.dumps(meta if format_ is None else {**meta, "format": format_}))


def refuse_to_prepare(*args, **kwargs):
    raise AssertionError("a cached corpus was prepared again")


def test_the_stdlib_cache_of_another_preparation_is_prepared_again(tmp_path, monkeypatch):
    """The stdlib cache was keyed by the Python version alone: a directory an older Ember had
    prepared (another format, other byte ids) was reused forever, and training read data the
    current code would not produce. Now it is keyed by the preparation too; the old directory,
    which an older Ember's process may be reading, is left as it was, and still opens."""
    fresh = [("a.py", "x = 1\n"), ("b.py", "def f():\n    return 2\n")]
    monkeypatch.setattr(corpus, "stdlib_documents", lambda: iter(fresh))
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    old = tmp_path / "cache" / "corpora" / f"python-stdlib-{platform.python_version()}"
    stale_preparation(old)
    directory = stdlib_corpus_dir()
    assert directory.parent == tmp_path / "cache" / "corpora" and directory != old
    assert sorted(texts_in(directory)) == sorted(text for _, text in fresh)
    assert texts_in(old) == ["stale = True\n"] and "format" not in TokenDataset.open(old).meta
    # The byte tokenizer is part of the key: a change of its description prepares again, once
    # (a description JSON does not hold as it is, here a tuple, is compared as meta.json reads back).
    described = ByteTokenizer().describe()
    monkeypatch.setattr(ByteTokenizer, "describe", lambda self: {**described, "eos_id": 1000, "merges": ()})
    changed = stdlib_corpus_dir()
    assert changed not in (directory, old) and TokenDataset.open(changed).meta["tokenizer"]["eos_id"] == 1000
    monkeypatch.setattr(corpus_cache, "prepare_token_files", refuse_to_prepare)
    assert stdlib_corpus_dir() == changed


@pytest.mark.parametrize("recorded", [None, PREPARATION_FORMAT - 1, PREPARATION_FORMAT + 1])
def test_a_cached_corpus_is_reused_only_while_it_records_this_preparation(tmp_path, monkeypatch, recorded):
    """The arithmetic cache (its directory given as an argument, not $EMBER_CACHE): reused as
    long as its meta.json records this preparation, without preparing anything; prepared again
    in place when it records another format or none; and a later Ember's format prepares a
    directory of its own."""
    directory = arithmetic_corpus_dir(max_operand=4, repeats=1, cache_dir=tmp_path)
    assert directory.parent == tmp_path / "corpora"
    expected = texts_in(directory)
    train, held_out = split_problems(arithmetic_problems(4))
    assert sorted(expected) == sorted(p.prompt + p.answer for p in train) and held_out

    with monkeypatch.context() as patch:
        patch.setattr(corpus_cache, "prepare_token_files", refuse_to_prepare)
        assert arithmetic_corpus_dir(max_operand=4, repeats=1, cache_dir=tmp_path) == directory
    stale_preparation(directory, recorded)
    assert arithmetic_corpus_dir(max_operand=4, repeats=1, cache_dir=tmp_path) == directory
    assert texts_in(directory) == expected and TokenDataset.open(directory).meta["format"] == PREPARATION_FORMAT
    for module in (corpus_cache, token_files):
        monkeypatch.setattr(module, "PREPARATION_FORMAT", PREPARATION_FORMAT + 1)
    later = arithmetic_corpus_dir(max_operand=4, repeats=1, cache_dir=tmp_path)
    assert later != directory and TokenDataset.open(later).meta["format"] == PREPARATION_FORMAT + 1
    assert texts_in(later) == expected and TokenDataset.open(directory).meta["format"] == PREPARATION_FORMAT


PREPARED = {
    1: {
        "format": 1,
        "tokenizer": {"type": "bytes", "vocab_size": 257, "eos_id": 256},
        "token_dtype": "uint16",
        "splits": {"train": {"tokens": 547, "documents": 89}, "val": {"tokens": 6, "documents": 1}},
        "fingerprint": "5ca3cd8e787be58f419e7c540df9ad18d78c6ca3402a042a5d86c5f858442c52",
        "val_fraction": 0.02,
    },
}
"""The meta.json each preparation format writes for the small arithmetic corpus below."""


def test_a_change_to_what_is_prepared_comes_with_a_new_preparation_format(tmp_path):
    """A small arithmetic corpus as PREPARATION_FORMAT prepares it: its generated documents, the
    byte ids and end-of-document id, the split rule and the metadata. A change that moves any of
    it must bump PREPARATION_FORMAT (and add its figures to PREPARED): with the old format, every
    built-in corpus cached before the change would still be reused as if current."""
    directory = arithmetic_corpus_dir(5, "+-", repeats=2, wrong_fraction=0.3, seed=1, cache_dir=tmp_path)
    assert TokenDataset.open(directory).meta == PREPARED.get(PREPARATION_FORMAT), (
        f"the built-in corpora now prepare differently from PREPARATION_FORMAT {PREPARATION_FORMAT}: bump it"
    )


def test_cli_prepare(tmp_path, capsys):
    files = []
    for name, text in make_documents(12):
        path = tmp_path / name
        path.write_text(text)
        files.append(str(path))
    assert main(["data", "prepare", *files, "--out", str(tmp_path / "out"), "--val-fraction", "0.25"]) == 0
    data = TokenDataset.open(tmp_path / "out")
    assert data.meta["splits"]["train"]["documents"] + data.meta["splits"]["val"]["documents"] == 12
    assert "wrote" in capsys.readouterr().out
    # Documents were named by their whole path, so the split moved with the directory the corpus
    # lay in (CI's temporary directory sent one of the two files below to validation). Named by
    # their text, each file keeps its side wherever it lies and whatever files join it.
    moved = tmp_path / "elsewhere" / "deeper"
    moved.mkdir(parents=True)
    for name, text in make_documents(12):
        (moved / name).write_text(text)
    moved_files = [str(moved / name) for name, _ in make_documents(12)]
    assert main(["data", "prepare", *moved_files, "--out", str(moved / "out"), "--val-fraction", "0.25"]) == 0
    assert TokenDataset.open(moved / "out").meta == data.meta
    (tmp_path / "elsewhere" / "extra.txt").write_text("one more document")
    extra = [*moved_files, str(tmp_path / "elsewhere" / "extra.txt")]
    assert main(["data", "prepare", *extra, "--out", str(moved / "more"), "--val-fraction", "0.25"]) == 0
    before, after = data.meta["splits"], TokenDataset.open(moved / "more").meta["splits"]
    grown = [split for split in ("train", "val") if after[split] != before[split]]
    assert len(grown) == 1 and after[grown[0]]["documents"] == before[grown[0]]["documents"] + 1
    assert main(["data", "prepare", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x")]) == 2
    # A pipe (`ember data prepare <(...)`) was refused as "not a file".
    with pipe_holding(tmp_path / "notes.fifo", "moo moo") as fifo:
        assert main(["data", "prepare", str(fifo), "--out", str(tmp_path / "piped"), "--val-fraction", "0"]) == 0
    assert TokenDataset.open(tmp_path / "piped").meta["splits"]["train"]["documents"] == 1
    # Documents are held out by a hash of their text: two files at the default 2% went both to training. Before,
    # nothing said so, and a run trained on them logged no val_loss without a word either.
    capsys.readouterr()
    assert main(["data", "prepare", *files[:2], "--out", str(tmp_path / "few")]) == 0
    assert "note: no document went to validation (--val-fraction 0.02 of 2 documents" in capsys.readouterr().out
    config = small_config(tmp_path, tmp_path / "few", "train.eval_batches=2")
    with pytest.warns(UserWarning, match=r"validation split of .*few holds 0 tokens.*logs no val_loss"):
        assert LMTask(config, TokenDataset.open(tmp_path / "few")).eval_data() is None


def test_cli_prepare_with_a_hugging_face_tokenizer(tmp_path):
    """The model's own tokenizer: the token files hold its ids and the dataset reads it back."""
    from ember.core.hf_tokenizer import load_hf_tokenizer
    from tests.training.finetune_setup import write_base_model

    base = write_base_model(tmp_path / "hf")
    text = tmp_path / "notes.txt"
    text.write_text("what does the cow say ? moo .")
    assert main(["data", "prepare", str(text), "--out", str(tmp_path / "out"), "--val-fraction", "0",
                 "--tokenizer", str(base)]) == 0  # fmt: skip
    data = TokenDataset.open(tmp_path / "out")
    tokenizer = load_hf_tokenizer(base)
    assert data.tokenizer.describe() == tokenizer.describe()
    assert np.asarray(data.train).tolist() == list(tokenizer.encode("what does the cow say ? moo .", add_eos=True))
