"""GSM8K rule-based reward on hand-written responses, for each extraction method."""

from __future__ import annotations

from decimal import Decimal

import pytest

from rlhf_core.rewards.gsm8k import compute_score, extract_answer, parse_ground_truth

GT_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72"


# --- strict: the '#### <number>' format is required ------------------------------------------------

@pytest.mark.parametrize("response,truth,expected", [
    ("48 + 24 = 72\n#### 72", "72", 1.0),                     # correct
    ("48 + 24 = 72\n#### 72", GT_SOLUTION, 1.0),              # ground truth given as a full solution
    ("#### 73", "72", 0.0),                                   # wrong, format_score defaults to 0
    ("The answer is 72.", "72", 0.0),                         # right number, no '####': no answer
    ("", "72", 0.0),                                          # empty
    ("#### 1,234", "1234", 1.0),                              # thousands separator
    ("#### $18", "18", 1.0),                                  # currency sign
    ("#### 18.", "18", 1.0),                                  # trailing period
    ("#### 18.00", "18", 1.0),                                # numbers compared as numbers
    ("#### -5", "-5", 1.0),                                   # negative
    ("#### 5", "-5", 0.0),                                    # sign matters
    ("#### 0.5", ".5", 1.0),                                  # decimals
    ("#### 2.5", "2.50", 1.0),
    ("#### 1,234,567", "1,234,567", 1.0),                     # ground truth parsed the same way
    ("#### 72\nthen more text #### 5", "72", 1.0),            # the first marker counts (as verl)
])
def test_strict(response, truth, expected):
    assert compute_score(response, truth, method="strict") == expected


def test_strict_format_score_and_score_scale():
    assert compute_score("#### 70", "72", method="strict", format_score=0.1, score=2.0) == 0.1
    assert compute_score("#### 72", "72", method="strict", format_score=0.1, score=2.0) == 2.0
    assert compute_score("72", "72", method="strict", format_score=0.1, score=2.0) == 0.0  # no format


# --- flexible: the common ways models state an answer ----------------------------------------------

@pytest.mark.parametrize("response,truth,expected", [
    ("The answer is $1,234.", "1234", 1.0),
    ("So the total is 6 + 12 = 18.00", "18", 1.0),
    ("Final answer: **18**", "18", 1.0),
    ("We get \\boxed{18} apples.", "18", 1.0),
    ("\\boxed{\\$18}", "18", 1.0),
    ("She has 3 apples, then 5, so 18", "18", 1.0),           # last-number fallback
    ("The answer is 18 apples, since 3 + 15 = 18 and 2 more boxes", "18", 1.0),  # phrase beats last number
    ("#### 18\nI hope that helps, 3 of them", "18", 1.0),     # the marker beats the last number
    ("The answer is -7.", "-7", 1.0),
    ("It costs -$5 in total, the answer is -$5", "-5", 1.0),
    ("10-3", "7", 0.0),                                       # '-3' is not read out of '10-3' ...
    ("10-3", "3", 1.0),                                       # ... the last number is 3
    ("The answer is 0.25", "0.250", 1.0),
    ("The answer is 19", "18", 0.0),                          # wrong
    ("I do not know.", "18", 0.0),                            # no number at all
    ("", "18", 0.0),
])
def test_flexible(response, truth, expected):
    assert compute_score(response, truth, method="flexible") == expected


def test_flexible_wrong_answer_gets_format_score_missing_answer_gets_zero():
    assert compute_score("The answer is 19", "18", method="flexible", format_score=0.1) == 0.1
    assert compute_score("no idea", "18", method="flexible", format_score=0.1) == 0.0


@pytest.mark.parametrize("text,value", [
    ("#### 72", Decimal(72)), ("1,234", Decimal(1234)), ("$18", Decimal(18)), ("18.", Decimal(18)),
    ("-3.5", Decimal("-3.5")), (GT_SOLUTION, Decimal(72)), ("no number", None),
])
def test_ground_truth_parsing(text, value):
    assert parse_ground_truth(text) == value


def test_extract_answer_rejects_an_unknown_method():
    with pytest.raises(ValueError, match="strict"):
        extract_answer("#### 1", method="loose")


def test_non_numeric_ground_truth_falls_back_to_text():
    assert compute_score("#### 5", "five", method="strict", format_score=0.2) == 0.2


def test_embedded_arith_answers_score_one_against_themselves(repo_root):
    """Every embedded problem's own solution is a correct strict answer to it."""
    import json

    rows = [json.loads(line) for line in (repo_root / "data/arith/train.jsonl").read_text().splitlines()[:200]]
    assert rows and all(compute_score(r["answer"], r["answer"], method="strict") == 1.0 for r in rows)
    assert all(compute_score(r["answer"], r["answer"], method="flexible") == 1.0 for r in rows)


def test_every_real_gsm8k_answer_parses_and_scores_itself(gsm8k_train):
    import json

    rows = [json.loads(line) for line in gsm8k_train.read_text().splitlines()]
    assert all(parse_ground_truth(r["answer"]) is not None for r in rows)
    assert all(compute_score(r["answer"], r["answer"], method="strict") == 1.0 for r in rows)
