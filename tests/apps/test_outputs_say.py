"""What the CLI prints says what it is: random weights named as such, the translator's own
target language, --top honoured."""

import re

from qkv.apps.cli import main
from qkv.apps.tour import _language


def test_explain_says_its_weights_are_random(capsys):
    assert main(["explain", "--text", "The boy trains the puppy ."]) == 0
    out = capsys.readouterr().out
    assert "Random weights" in out
    lines = [line for line in out.splitlines() if "attends most to" in line]
    assert lines and all("(random weights)" in line for line in lines)


def test_heads_top_limits_the_statistics(capsys):
    assert main(["heads", "The boy trains the puppy ."]) == 0
    every = capsys.readouterr().out
    assert main(["heads", "The boy trains the puppy .", "--top", "3"]) == 0
    top = capsys.readouterr().out
    m = re.search(r"the 3 of (\d+) heads with the lowest entropy", " ".join(top.split()))
    assert m and int(m.group(1)) > 3

    def rows(out: str) -> list[str]:
        return [line for line in out.splitlines() if re.match(r"\s*\S*layers\.\d", line)]

    assert len(rows(top)) == 3 and len(rows(every)) == int(m.group(1))


def test_the_tour_names_the_translators_target_language():
    assert _language("en-fr", "target") == "French"
    assert _language("fr-en", "target") == "English"
    assert _language("/some/dir/my-model", "target") == "output"


def test_the_tour_writes_into_a_folder_of_its_own_by_default():
    from qkv.apps.cli import build_parser

    assert build_parser().parse_args(["tour"]).out_dir == "qkv-tour"
