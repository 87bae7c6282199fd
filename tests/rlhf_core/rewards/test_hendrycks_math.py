"""verl's MATH rule (math_reward.py): last boxed answer, lm-eval-harness normalisation, string equality.

The expected values were also checked against verl's own function (volcengine/verl at b178a3c) on
these cases and on 200,000 seeded random strings built from the characters the rule reacts to:
no difference."""

from __future__ import annotations

import pytest

from rlhf_core.rewards.hendrycks_math import compute_score, last_boxed, normalize, same_answer, unbox


@pytest.mark.parametrize("response,truth,expected", [
    ("so \\boxed{\\frac12}", "\\frac{1}{2}", 1.0),             # \frac12 → \frac{1}{2}
    ("\\boxed{\\frac1{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),           # dfrac / tfrac → frac
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),                      # 0.5 → \frac{1}{2}
    ("\\boxed{.5}", "\\frac{1}{2}", 1.0),                       # leading '.' gets a 0
    ("\\boxed{3/4}", "\\frac{3}{4}", 1.0),                      # integer ratio → \frac
    ("\\boxed{3/x}", "\\frac{3}{x}", 0.0),                      # ... integers only
    ("$\\boxed 5$ done", "5", 1.0),                             # '\boxed ' up to the next '$'
    ("\\boxed{x = 2}", "2", 1.0),                               # short 'x =' prefix dropped
    ("\\boxed{abc = 2}", "2", 0.0),                             # ... at most two characters
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{5\\text{ cm}}", "5", 1.0),                        # units after '\text{ ' dropped
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),          # \left, \right and spaces dropped
    ("\\boxed{\\sqrt3}", "\\sqrt{3}", 1.0),
    ("\\boxed{\\sqrt}", "\\sqrt", 1.0),                         # cannot normalise: raw strings compared
    ("\\boxed{\\sqrt}", "\\sqrt{}", 0.0),
    ("\\boxed{1\\text{ a}\\text{ b}}", "1\\text{ a}\\text{ b}", 1.0),  # two unit markers: raw comparison
    ("\\boxed{2} then \\boxed{3}", "3", 1.0),                   # the last box counts
    ("\\boxed{2} then \\boxed{3}", "2", 0.0),
    ("\\boxed{\\frac{1}{\\boxed{2}}", "2", 1.0),               # the last \boxed, its braces matched
    ("\\fbox{5}", "5", 0.0),                                    # found, never unwrapped (verl)
    ("\\boxed{5", "5", 0.0),                                    # unclosed
    ("no box 5", "5", 0.0),
    ("", "5", 0.0),
])
def test_cases(response, truth, expected):
    assert compute_score(response, truth) == expected


def test_pieces():
    assert last_boxed("a \\boxed{x{y}} b") == "\\boxed{x{y}}" and last_boxed("none") is None
    assert unbox("\\boxed{x{y}}") == "x{y}" and unbox("\\boxed 7") == "7"
    assert normalize("k = \\dfrac{1}{2}\n") == "\\frac{1}{2}" and normalize("") == ""
    assert same_answer(None, None) and not same_answer("1", None)
