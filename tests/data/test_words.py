"""qkv.data.words: the script-aware splitter of qkv explain."""

import doctest
import unicodedata

from hypothesis import given
from hypothesis import strategies as st

import qkv.data.words
from qkv.data.words import count_words, first_words, split_words


def test_doctests():
    failed, tried = doctest.testmod(qkv.data.words)
    assert failed == 0 and tried > 5


def test_spaced_scripts_split_on_spaces_and_punctuation():
    assert split_words("The boy trains the puppy .") == [
        "The",
        "boy",
        "trains",
        "the",
        "puppy",
        ".",
    ]
    assert split_words("Le garçon, aujourd’hui?") == ["Le", "garçon", ",", "aujourd’hui", "?"]
    # Devanagari and Bengali vowel signs are marks: they stay inside their word.
    assert split_words("लड़का कुत्ते को सिखाता है।") == ["लड़का", "कुत्ते", "को", "सिखाता", "है", "।"]
    assert split_words("ছেলেটি কুকুরছানাকে প্রশিক্ষণ দেয়।")[:3] == ["ছেলেটি", "কুকুরছানাকে", "প্রশিক্ষণ"]
    assert split_words("Cậu bé huấn luyện chú chó con.") == [
        "Cậu", "bé", "huấn", "luyện", "chú", "chó", "con", "."
    ]  # fmt: skip


def test_chinese_and_japanese_are_one_token_per_character():
    assert split_words("男孩训练小狗。") == ["男", "孩", "训", "练", "小", "狗", "。"]
    assert count_words("少年は子犬を訓練する。") == 11
    assert split_words("AI模型") == ["AI", "模", "型"]


def test_burmese_syllables():
    # Standard syllable breaks (the "sylbreak" rule) of real words: Myanmar, school,
    # mingalaba (kinzi: the stacked ဂ stays with မင်္), "trains" (dot below before asat).
    assert split_words("မြန်မာ") == ["မြန်", "မာ"]
    assert split_words("ကျောင်း") == ["ကျောင်း"]
    assert split_words("မင်္ဂလာပါ") == ["မင်္ဂ", "လာ", "ပါ"]
    assert split_words("ကောင်လေးက ခွေးကလေးကို လေ့ကျင့်ပေးတယ်။") == [
        "ကောင်", "လေး", "က", "ခွေး", "က", "လေး", "ကို", "လေ့", "ကျင့်", "ပေး", "တယ်", "။"
    ]  # fmt: skip


def test_thai_lao_khmer_come_out_as_syllable_like_clusters():
    assert split_words("เด็กผู้ชายฝึกลูกสุนัข") == ["เด็ก", "ผู้", "ชาย", "ฝึก", "ลูก", "สุ", "นัข"]
    assert split_words("ເດັກຊາຍ") == ["ເດັກ", "ຊາຍ"]
    assert split_words("ក្មេងប្រុស កូនឆ្កែ") == ["ក្មេង", "ប្រុស", "កូន", "ឆ្កែ"]


_MIXED = st.sampled_from(
    list("ab .,'-!\u0301\u200d")
    + [chr(c) for c in range(0x1000, 0x1050)]  # Myanmar
    + [chr(c) for c in range(0x0E01, 0x0E4F)]  # Thai
    + [chr(c) for c in range(0x1780, 0x17DD)]  # Khmer
    + list("男孩训练。ーは")
)


@given(st.text(max_size=60) | st.text(_MIXED, max_size=40))
def test_nothing_is_lost_and_marks_stay_on_their_letter(s):
    s = unicodedata.normalize("NFC", s)
    words = split_words(s)
    assert "".join(words) == "".join(s.split())
    assert all(words) and not any(w.isspace() for w in words)
    pos = 0
    for w in words:  # a token starts with a mark only where a space cut it from its letter
        pos = s.index(w, pos)
        if unicodedata.category(w[0])[0] == "M" and pos > 0:
            assert s[pos - 1].isspace()
        pos += len(w)


@given(st.text(_MIXED, max_size=80), st.integers(1, 12))
def test_first_words_keeps_exactly_the_first_tokens(s, limit):
    prefix, was_cut = first_words(s, limit)
    words = split_words(s)
    assert unicodedata.normalize("NFC", s).startswith(prefix)
    assert split_words(prefix) == words[:limit] and was_cut == (len(words) > limit)


def test_digits_and_signs_are_no_final_consonant():
    assert split_words("ดี๑") == ["ดี", "๑"]
    assert split_words("ကျောင်း ၁၂") == ["ကျောင်း", "၁", "၂"]
