"""Multi30k reading, the BPE tokenizer (Unicode round trips), token-bucketed batches."""

import gzip
import os

import pytest
import torch

from qkv.data import (
    Tokenizer,
    collate,
    default_data_dir,
    encode_pairs,
    epoch_order,
    make_batches,
    multi30k,
    read_parallel,
)
from qkv.data.corpus import splits

# Tiny models: extra threads only add synchronisation on this shared 2-core machine.
torch.set_num_threads(1)

MULTI30K = default_data_dir()
# CI has ../shared beside the clone: there a missing data set is a failure, not a skip.
needs_data = pytest.mark.skipif(
    MULTI30K is None and os.environ.get("CI") != "true", reason="Multi30k not found"
)

SAMPLES = [
    "The boy trains the puppy.",
    "Le garçon entraîne le chiot.",
    "မြန်မာဘာသာစကား",  # Myanmar
    "বাংলা ভাষা আমার",  # Bengali
    "Tiếng Việt có dấu: ắ ằ ẳ ẵ ặ",  # Vietnamese
    "中文文本测试，你好！",  # Chinese
    "  leading and trailing spaces  ",
    "emoji 🐶 and tabs\tok",
]


@pytest.fixture(scope="module")
def tok():
    corpus = ["the boy trains the puppy", "le garçon entraîne le chiot", "a dog runs"] * 20
    return Tokenizer.train(corpus, vocab_size=300, min_frequency=1)


@pytest.mark.parametrize("text", SAMPLES)
def test_unicode_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.unk_id not in ids  # byte-level: nothing is unknown
    assert tok.decode(ids) == text


def test_round_trip_is_nfc(tok):
    decomposed = "Vie\u0302\u0323t"  # e + combining circumflex + dot below
    assert tok.decode(tok.encode(decomposed)) == "Việt"


def test_decode_stops_at_eos_and_skips_specials(tok):
    ids = tok.encode("a dog")
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, *tok.encode("runs"), 0]) == "a dog"


def test_save_load_same_ids(tok, tmp_path):
    tok.save(tmp_path / "tokenizer.json")
    again = Tokenizer.load(tmp_path)
    for text in SAMPLES:
        assert again.encode(text) == tok.encode(text)
    assert again.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]


def test_bpe_merges_frequent_words(tok):
    assert len(tok.encode("the puppy")) < len(b"the puppy")
    with pytest.raises(TypeError, match="text must be str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="vocab_size must be"):
        Tokenizer.train(["x"], vocab_size=10)


@needs_data
def test_multi30k_splits_and_languages():
    val = multi30k("val")
    assert len(val) == 1014 and all(isinstance(s, str) and t for s, t in val)
    test = multi30k("test_2016_flickr", "en", "de")
    assert len(test) == 1000
    assert multi30k("test_2016_flickr", "en", "fr")[0][0] == test[0][0]  # same English side


def test_missing_files_are_named(tmp_path):
    (tmp_path / "val.en.gz").write_bytes(gzip.compress(b"a\n"))
    (tmp_path / "test_2016_flickr.en.gz").write_bytes(gzip.compress(b"a\n"))
    (tmp_path / "test_2016_flickr.fr.gz").write_bytes(gzip.compress(b"b\n"))
    with pytest.raises(FileNotFoundError, match=r"no split 'val' .*present: test_2016_flickr"):
        multi30k("val", "en", "fr", tmp_path)
    with pytest.raises(FileNotFoundError, match="missing data directory"):
        multi30k("val", "en", "fr", tmp_path / "nope")
    for bad in ("../val", "a/b", ""):
        with pytest.raises(ValueError, match="split must be a plain name"):
            multi30k(bad, "en", "fr", tmp_path)


def test_any_present_split_is_read(tmp_path):
    """Official test sets beyond the usual four (test_2018_flickr, test_2017_mscoco) work."""
    for split in ("test_2018_flickr", "test_2017_mscoco"):
        (tmp_path / f"{split}.en").write_text("A dog.\nA cat.\n", encoding="utf-8")
        (tmp_path / f"{split}.fr.gz").write_bytes(gzip.compress(b"Un chien.\nUn chat.\n"))
        assert multi30k(split, "en", "fr", tmp_path) == [
            ("A dog.", "Un chien."),
            ("A cat.", "Un chat."),
        ]
    assert splits(tmp_path, "en", "fr") == ["test_2017_mscoco", "test_2018_flickr"]


def test_plain_parallel_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello\nworld\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("bonjour\nmonde\n", encoding="utf-8")
    assert read_parallel(tmp_path / "a.txt", tmp_path / "b.txt") == [
        ("hello", "bonjour"),
        ("world", "monde"),
    ]
    (tmp_path / "c.txt").write_text("un\n", encoding="utf-8")
    with pytest.raises(ValueError, match="differ in length"):
        read_parallel(tmp_path / "a.txt", tmp_path / "c.txt")


def test_token_buckets_cover_everything_within_budget():
    g = torch.Generator().manual_seed(0)
    examples = [
        (
            [5] * int(torch.randint(1, 30, (1,), generator=g)),
            [6] * int(torch.randint(1, 30, (1,), generator=g)),
        )
        for _ in range(500)
    ]
    batches = make_batches(examples, max_tokens=200)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(500))  # every example exactly once
    for b in batches:
        b_ex = collate(examples, b)
        assert b_ex.src.numel() <= 200 and b_ex.tgt_in.numel() <= 200
    assert epoch_order(len(batches), 1, 3) == epoch_order(len(batches), 1, 3)
    assert epoch_order(len(batches), 1, 3) != epoch_order(len(batches), 1, 4)


def test_collate_shifts_targets(tok):
    ex = encode_pairs(tok, [("a dog", "le chiot"), ("the boy trains", "a")])
    b = collate(ex, [0, 1])
    assert (b.src[:, :1] != 0).all() and b.src[0, len(ex[0][0]) - 1] == tok.eos_id
    assert (b.tgt_in[:, 0] == tok.bos_id).all()
    assert torch.equal(b.tgt_in[0, 1 : len(ex[0][1]) + 1], b.tgt_out[0, : len(ex[0][1])])
    assert (
        b.tgt_out[1, len(ex[1][1])] == tok.eos_id
        and b.n_tokens == len(ex[0][1]) + len(ex[1][1]) + 2
    )
