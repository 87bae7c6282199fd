"""verl's DAPO rule (math_dapo.py, as its default reward calls it): the last "Answer:" line in the
final 300 characters, Minerva normalisation, string equality, ±1.

The expected values were also checked against verl's own function (volcengine/verl at b178a3c) on
these cases and on 200,000 seeded random strings built from the pieces the rule reacts to: no difference."""

from __future__ import annotations

import pytest

from rlhf_core.rewards.dapo_math import compute_score, normalize_final_answer, prediction

PADDING = "We keep reasoning here. " * 15  # 360 characters


@pytest.mark.parametrize("response,truth,correct", [
    ("Thus... Answer: 42", "42", True),
    ("answer : 42\n", "42", True),                          # any case, spaces around ':'
    ("Answer: 41\nAnswer: 42", "42", True),                 # the last one counts
    ("Answer: 42\nAnswer: 41", "42", False),
    ("Answer: $1,000$", "1000", True),                      # '$' dropped, separators of integers removed
    ("Answer: 1,000.5", "1000.5", False),                   # ... of integers only
    ("Answer: x = 5", "5", True),                           # text after the last '='
    ("Answer: 5 cm", "5", True),                            # unit words removed
    ("Answer: 90^\\circ", "90", True),
    ("Answer: \\frac12", "\\frac{1}{2}", True),             # \fracab braced
    ("Answer: \\sqrt3", "\\sqrt{3}", True),
    ("Answer: \\boxed{7}", "7", True),
    ("Answer: \\text{seven}", "seven", True),
    ("Answer: 42" + PADDING, "42", False),                  # beyond the last 300 characters
    (PADDING + "Answer: 42", "42", True),
    ("The result is 42.", "42", False),                     # no "Answer:" line
    ("", "[INVALID]", True),                                # verl's placeholder compares as text
])
def test_cases(response, truth, correct):
    result = compute_score(response, truth)
    assert result == {"score": 1.0 if correct else -1.0, "acc": correct, "pred": prediction(response)}


def test_normalisation_pieces():
    assert normalize_final_answer("a cat = 3 points") == "3"
    assert normalize_final_answer("$\\text{(A)}$ and $5$") == "(A)"  # the first $...$ only
    assert prediction("Answer: 12 dollars") == "12"
