"""Notes on a source text the shipped translators are likely to get wrong, from the text alone.

The translators learned from Multi30k: 29,000 image captions, descriptive, in the present
tense, with almost no names, questions or digits. Cheap checks of the source (no model run)
say when a text is far from that, so that a caller can warn instead of showing a confident
mistranslation (:mod:`qkv.translate` copies names and numbers through placeholders, but the
words around them may still suffer):

* ``unseen``: several words the tokenizer splits into many pieces (it has not seen them:
  names, technical or formal words); such words come out garbled or are left out;
* ``numbers``: digits not glued to a letter (1% of the English captions have any; "12" is the tokens "1", "2", which
  the models copy badly);
* ``language``: the text looks like another language of Multi30k than the one the model reads
  (its words are among the most frequent of the other language's captions and not of its own);
* ``question``: a question mark (4 of the 29,000 captions).

Each note is a dict ``{"code": ..., ...}`` like :func:`qkv.translate.source_warnings`' (a page
can say a code in its reader's language, as the explorer does: qkv.apps.serve.decoding);
:func:`note_text` gives its English. The
thresholds were tuned on Multi30k val (sentences 200 on) and a stress set built from train and
hand-written lines (``tests/data/translate_stress.tsv``), never on a test split: the notes stay
silent on 96% of the first 200 val sentences (docs/translation.md has the numbers).

>>> from qkv.data import Tokenizer
>>> tok = Tokenizer.train(["where does the dog run at night"] * 20, vocab_size=300)
>>> [n["code"] for n in source_notes(tok, "where does the dog run at 7?", "en")]
['numbers', 'question']
"""

from __future__ import annotations

import re

__all__ = [
    "NOTES", "TRANSLATED_CAPITALS", "find_names", "guess_language", "note_text", "source_notes",
    "unseen_words",
]

NOTES = {
    "unseen": "The model has not seen several of these words ({words}): they may come out "
              "garbled or be left out.",
    "numbers": "Numbers may be copied wrong: the model learned from captions with few digits.",
    "language": "This looks like {looks}, but this model reads {reads}.",
    "question": "A question: the model was trained on descriptions of images, not questions.",
}  # fmt: skip

LANGUAGE_NAMES = {"en": "English", "fr": "French", "de": "German"}

# The 120 most frequent words (2 letters or more, lower case) of each language's side of
# Multi30k train whose frequency in the other two languages' captions is under 2% of theirs.
LANGUAGE_WORDS = {
    "en": (
        "the on man is and of with woman two are to people at wearing young white black his "
        "while blue men red sitting girl dog standing playing group street down walking front "
        "holding one water three by women up green little for child looking outside as large "
        "through brown yellow children from their into small next other dressed some out over "
        "building riding running near jacket another around sidewalk field crowd stands sits "
        "jumping behind snow grass hair background player asian looks wall off several that "
        "dogs older camera dress talking lady something soccer along walks guitar play "
        "together working gray smiling picture has game plays holds it road him bench old "
        "glasses pants stage sit carrying walk them side"
    ),
    "fr": (
        "un une de en dans sur homme et avec la femme deux le est debout se personnes sont "
        "jeune tandis au devant hommes fille du groupe les garçon assis chien rue rouge qu "
        "noir portant blanc pour gens trois bleu eau femmes fait enfant enfants qui sa côté "
        "tient par petit autre regarde que joue près personne tenant vêtu jouant il jaune "
        "chemise jeunes vélo petite jouent lors regardant arrière dehors plan bâtiment marche "
        "blanche lunettes tout veste ses assise trottoir dessus faisant saute regardent "
        "cheveux foule marchant vert derrière plage porte bleue neige main quelque plusieurs "
        "rose chose autres filles brun herbe tenue marchent aux quatre chiens chapeau sous "
        "vers ville noire mur autour leurs soleil font balle guitare"
    ),
    "de": (
        "ein einem eine und mit auf mann einer der frau die zwei einen im von sich dem "
        "mädchen junge vor zu steht männer sitzt hund den straße während gruppe hält spielt "
        "das hemd personen über drei eines weißen blauen frauen roten neben ist stehen sitzen "
        "menschen am spielen aus durch bei geht trägt fährt wasser um kinder kleines macht "
        "springt schwarzen kleiner entlang leute gehen etwas mehrere seinem oberteil großen "
        "jungen grünen läuft sind fahrrad hintergrund für freien jacke luft strand anderen "
        "kleidung schaut junger gelben hinter sie nach schwarz andere kleine schwarzer "
        "gebäude tisch vier wird beim nähe essen kleinen menschenmenge weißer kamera vorbei "
        "gras paar hoch hunde boden schnee rennt ihre unter gitarre ihren kleid älterer sein "
        "zusammen"
    ),
}
_WORDS = {lang: frozenset(words.split()) for lang, words in LANGUAGE_WORDS.items()}

# Another language: at least this many of its words, and more than twice the model's own
# language's. On Multi30k val it names the language of 99.8% of the French (and German)
# sentences given to en-fr, 96.3% of the English (99.8% German) given to fr-en, and fires on
# none of the model's own language.
LANGUAGE_MIN_HITS = 2

# A word looks unseen when the tokenizer splits it into at least UNSEEN_PIECES pieces, or into
# UNSEEN_PIECES - 1 of which one is a single letter, or (a name) it is capitalised inside the
# sentence and split at all (a capitalised word joined to a name by "and" is a name too: "John
# and Maria"). Among the words of Multi30k val, 4+ pieces: about half are not in train; 1
# piece: 0.04%. A note needs UNSEEN_WORDS such words, or MANY_PIECES_WORDS words of 3+ pieces
# (formal French: "habitants", "visiteurs", "étrangers"): one rare word in a caption is common
# (15% of val sentences have a word train lacks) and usually translated well; a single name
# alone would add a note to 2-3% more val sentences.
UNSEEN_PIECES = 4
UNSEEN_WORDS = 2
MANY_PIECES_WORDS = 4

# Capitalised words that Multi30k train's captions translate rather than copy ("Asian" ->
# "asiatique", "Noël" -> "Christmas"): on the source side at least twice, and the same word in
# fewer than half of their reference translations; at a sentence's start only words whose
# lower case the tokenizer splits (the others are plain words anyway). Every other capitalised
# word inside a sentence is taken for a name (:func:`find_names`).
TRANSLATED_CAPITALS = {
    "en": (
        "Africa African America American Americans Amish Arab Arabic Army Asia Asian Asians "
        "Attractive Autumn Blurry Brazil Bridesmaids British Buddhist Cafe Canadian Caucasian "
        "China Chinese Christmas City Claus Commuters Crowds Dad Dane Darth Diners Dozens "
        "East Easter Eastern Elder Elderly Elementary Eleven Employees European Farmers "
        "Father Fire Firetrucks Fishermen Flag Food Free French Frisbee German Great "
        "Greyhound Happy Hawaiian Hispanic Hockey India Indian Indians Islamic Italian Italy "
        "Japan Japanese Jesus Jewish Jockeys Joggers Kayaker Korean Latin Latino Law "
        "Lifeguards London Maintenance Man McDonalds Mexican Mexico Middle Mohawk Mr Mrs "
        "Muslim Muzzled Native Nine Numerous Nurses Ocean Olympians Olympic Olympics Oriental "
        "Painters Parade People Photographers Police Profile Protesters Renaissance Rican "
        "Rollerblader Rollerblades Russian Santa School Scottish Shepherd Shoppers Shorts "
        "Skiers Skiiers Somebody Southeast Spain Spanish Spider SpongeBob SquarePants St Star "
        "States Station Styrofoam Sunday Sveral Team These Thursday Tree Twelve Tye United "
        "University Veteran Vietnamese Walkers Waterskier Welcome Western White Women Workman "
        "Workmen Year Young"
    ),
    "fr": (
        "Africain Africains Afrique Afro Américain Américains Amérindiens Amérique An "
        "Angleterre Asiatique Asiatiques Asie Barbie Batman Bienvenue Blanche Bob Breakdance "
        "Brésil Café Cela Ces Cet Chinatown Chine Chinois Converse Danois Dark Deux Dieu "
        "Douze Environ Espagne Est Grande Gym Inde Indien Indiens Internet Italie Japon "
        "Japonaises Jeux Jungle Jésus Lego Les Light Londres Mac Martini McDo Mexique "
        "Monopoly Moyen Mère Neuf Nous Nouveau Nouvel Noël Olympiques Onze Orient PowerPoint "
        "Pâques Père Quarte Regardez Saint Scrabble Sept Sud Superman Un Une Unis Vador Voici "
        "Ça États"
    ),
}
_CAPITALS = {lang: frozenset(words.split()) for lang, words in TRANSLATED_CAPITALS.items()}

_WORD = re.compile(r"[^\W\d_]+")
_NUMBER = re.compile(r"(?<![^\W\d_])\d")  # a digit not glued to a letter ("MP3", "dog0")
_AND = re.compile(r"\s+(?:and|et|und|&)\s+", re.IGNORECASE)
_SENTENCE_START = re.compile(r"(?:^|[.!?…:;]\s+)[\"'«“(\[]*$")


def guess_language(text: str) -> dict[str, int]:
    """How many of ``text``'s words are among each language's most frequent caption words
    (:data:`LANGUAGE_WORDS`): ``{"en": n, "fr": n, "de": n}``.

    >>> guess_language("Un chien court dans le parc.")
    {'en': 0, 'fr': 4, 'de': 0}
    """
    words = [w.lower() for w in _WORD.findall(text)]
    return {lang: sum(w in vocab for w in words) for lang, vocab in _WORDS.items()}


def _looks_like(text: str, src: str) -> str | None:
    """The language ``text`` looks written in when it is not ``src`` (else ``None``)."""
    hits = guess_language(text)
    own = hits.get(src, 0)
    other = max((lang for lang in hits if lang != src), key=hits.__getitem__)
    if hits[other] >= LANGUAGE_MIN_HITS and hits[other] > 2 * own:
        return other
    return None


def unseen_words(tokenizer, text: str) -> list[str]:
    """The words of ``text`` that look unseen by the model (module docstring), in order, each
    once; ``[]`` when fewer than a note needs.

    >>> from qkv.data import Tokenizer
    >>> tok = Tokenizer.train(["a dog runs on the grass with a ball"] * 20, vocab_size=300)
    >>> unseen_words(tok, "a dog runs on the photosynthesis with Kubernetes")
    ['photosynthesis', 'Kubernetes']
    """
    matches = list(_WORD.finditer(text))
    if not matches:
        return []
    pieces = tokenizer.encode_batch([m[0] for m in matches])
    unseen, split = [], []  # words that look unseen; words of 3+ pieces
    for j, (m, ids) in enumerate(zip(matches, pieces)):
        word, n = m[0], len(ids)
        single = n > 1 and any(len(tokenizer.decode([i]).strip()) == 1 for i in ids)
        inside = not _SENTENCE_START.search(text[: m.start()])
        name = inside and n > 1 and word[0].isupper() and not word.isupper()
        if n >= UNSEEN_PIECES or (n == UNSEEN_PIECES - 1 and single) or name:
            if name and j >= 2 and _joined(text, matches[j - 2], m):
                unseen.append(matches[j - 2][0])  # "John and Maria": John is a name too
            unseen.append(word)
        if n >= UNSEEN_PIECES - 1:
            split.append(word)
    unseen = list(dict.fromkeys(unseen))
    if len(unseen) >= UNSEEN_WORDS:
        return unseen
    split = list(dict.fromkeys(split))
    return split if len(split) >= MANY_PIECES_WORDS else []


def find_names(
    tokenizer, text: str, src: str | None, *, join: bool = False
) -> list[tuple[int, int]]:
    """The ``(start, end)`` spans of ``text`` that look like names, for a model reading ``src``
    (``"en"``, ``"fr"``; any other language, German's capitalised nouns among them: ``[]``).

    A name is a capitalised word (not in capitals, two letters or more) that the training
    captions do not translate (:data:`TRANSLATED_CAPITALS`): inside a sentence, any such word;
    at its start, one whose lower case the tokenizer splits (it is no common word: "Olga",
    not "Three"), or one joined to a name by "and" ("Jean et Marie"). Names one space or a
    hyphen apart are one span ("New York", "Jean-Pierre"); with ``join``, names joined by
    "and" ("et", "und", "&") too ("John and Maria").

    >>> from qkv.data import Tokenizer
    >>> tok = Tokenizer.train(["two men walk on the road with a dog"] * 20, vocab_size=300)
    >>> text = "Two men walk with Olga Petrova in New York."
    >>> [text[a:b] for a, b in find_names(tok, text, "en")]
    ['Olga Petrova', 'New York']
    >>> text = "Olga and Ivan walk."
    >>> [text[a:b] for a, b in find_names(tok, text, "en", join=True)]
    ['Olga and Ivan']
    """
    known = _CAPITALS.get(src or "")
    if known is None:
        return []
    matches = list(_WORD.finditer(text))
    words = [m[0] for m in matches]
    capital = [len(w) >= 2 and w[0].isupper() and not w.isupper() and w not in known
               for w in words]  # fmt: skip
    start = [bool(_SENTENCE_START.search(text[: m.start()])) for m in matches]
    name = [c and (not s or len(tokenizer.encode(w.lower())) >= 2)
            for c, s, w in zip(capital, start, words)]  # fmt: skip
    for j in range(len(matches) - 2, -1, -1):  # "Jean et Marie", "New York": joined to a name
        if capital[j] and not name[j] and (
            (name[j + 1] and text[matches[j].end() : matches[j + 1].start()] in (" ", "-"))
            or (j + 2 < len(matches) and name[j + 2] and _joined(text, matches[j], matches[j + 2]))
        ):
            name[j] = True
    spans: list[tuple[int, int]] = []
    for j, m in enumerate(matches):
        if not name[j]:
            continue
        between = text[spans[-1][1] : m.start()] if spans else ""
        if spans and (between in (" ", "-") or join and _AND.fullmatch(between)):
            spans[-1] = (spans[-1][0], m.end())
        else:
            spans.append((m.start(), m.end()))
    return spans


def _joined(text: str, first: re.Match, name: re.Match) -> bool:
    """Whether ``first`` is a capitalised word joined to ``name`` by "and" ("et", "und", "&")."""
    return first[0][0].isupper() and bool(_AND.fullmatch(text[first.end() : name.start()]))


def source_notes(tokenizer, text: str, src: str | None = None) -> list[dict]:
    """Why ``text`` may be translated badly, as ``[{"code": ...}]`` (module docstring); ``src``,
    the language the model reads (``"en"``, ``"fr"``; ``None``: no language check). ``[]`` for
    an ordinary caption."""
    out: list[dict] = []
    if src in _WORDS and (looks := _looks_like(text, src)) is not None:
        out.append({"code": "language", "looks": looks, "reads": src})
    if unseen := unseen_words(tokenizer, text):
        out.append({"code": "unseen", "words": unseen})
    if _NUMBER.search(text):
        out.append({"code": "numbers"})
    if "?" in text or "¿" in text:
        out.append({"code": "question"})
    return out


def note_text(note: dict) -> str:
    """The English sentence of one of :func:`source_notes`' notes."""
    fields = dict(note)
    if "words" in fields:
        words = fields["words"]
        fields["words"] = ", ".join(words[:4]) + (", ..." if len(words) > 4 else "")
    for key in ("looks", "reads"):
        if key in fields:
            fields[key] = LANGUAGE_NAMES.get(fields[key], fields[key])
    return NOTES[note["code"]].format(**fields)
