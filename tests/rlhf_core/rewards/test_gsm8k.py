"""The GSM8K rule against an independent transcription of verl's ``reward_score/gsm8k.py``.

``verl_reference`` below restates verl's rule step by step (written here, not copied): keep the last
300 characters; strict = the last "#### " + [-]digits/dots/commas match with commas removed;
flexible = the last run of [-]digits/dots/commas that is not "" or "." (verbatim); no answer → 0,
string-equal to the ground truth → score, else format_score.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from rlhf_core.rewards.gsm8k import SOLUTION_CLIP_CHARS, compute_score, extract_solution


def verl_reference(solution: str, truth: str, method: str = "strict", format_score: float = 0.0,
                   score: float = 1.0) -> float:
    if len(solution) > 300:
        solution = solution[len(solution) - 300:]
    if method == "strict":
        hits = [m.group(1) for m in re.finditer(r"####\s(-?[\d.,]+)", solution) if m.group(0)[4] == " "]
        answer = hits[-1].replace(",", "").replace("$", "") if hits else None
    else:
        hits = re.findall(r"-?[\d.,]+", solution)
        answer = None
        for candidate in hits[::-1]:
            answer = candidate
            if candidate not in ("", "."):
                break
    if answer is None:
        return 0
    return score if answer == truth else format_score


PADDING = "Let me think about this carefully. " * 12  # 420 characters

CASES = [
    # (response, ground truth)
    ("48 + 24 = 72\n#### 72", "72"),
    ("#### 73", "72"),
    ("The answer is 72.", "72"),                      # no marker: strict finds nothing
    ("", "72"),
    ("#### 1,234", "1234"),                           # commas removed (strict)
    ("#### 1,234,567", "1234567"),
    ("The total is 1,234", "1234"),                   # flexible keeps the comma: not equal
    ("The total is 1,234", "1,234"),
    ("#### -5", "-5"),                                # negative
    ("#### 5", "-5"),
    ("#### --5", "-5"),                               # '-' not followed by a digit run: no match after '#### '
    ("#### 0.5", "0.5"),                              # decimals compared as text
    ("#### 0.50", "0.5"),
    ("#### .5", ".5"),
    ("#### 18.", "18"),                               # trailing period kept: "18." != "18"
    ("#### 18.00", "18"),
    ("#### $18", "18"),                               # '$' is not in the class: no strict match
    ("####18", "18"),                                 # no space: no strict match
    ("####  18", "18"),                               # two spaces: no strict match
    ("#### 72\nthen more #### 5", "5"),               # the LAST marker counts
    ("#### 72\nthen more #### 5", "72"),
    ("#### 7 #### 8 #### 9", "9"),
    ("#### 72" + PADDING, "72"),                      # marker beyond the last 300 characters: not seen
    (PADDING + "#### 72", "72"),
    ("#### 1" + PADDING[:290] + "#### 2", "2"),
    ("#### 42" + "x" * 294, "42"),                    # 301 chars: the first '#' is cut, no marker left
    ("#### 42" + "x" * 293, "42"),                    # exactly 300 chars: kept whole
    ("She has 3 apples, then 5, so 18", "18"),        # flexible: last number
    ("So 18, ", "18"),                                # flexible takes "18," verbatim
    ("Answer: 18.", "18"),
    ("Answer: 18 .", "18"),                           # the lone "." is skipped
    ("... . .", "18"),                                # only dots: verl's loop ends on the first
    (".", "."),
    ("10-3", "-3"),                                   # flexible reads "-3" out of "10-3"
    ("The answer is -7", "-7"),
    ("I do not know.", "18"),
    ("no digits at all", "18"),
    ("#### 3.14.15", "3.14.15"),
]


@pytest.mark.parametrize("method", ["strict", "flexible"])
@pytest.mark.parametrize("response,truth", CASES)
def test_matches_verl_on_hand_written_cases(response, truth, method):
    for format_score, score in ((0.0, 1.0), (0.1, 2.0)):
        expected = verl_reference(response, truth, method, format_score, score)
        assert compute_score(response, truth, method, format_score, score) == expected


@pytest.mark.parametrize("method", ["strict", "flexible"])
def test_matches_verl_on_random_strings(method):
    """Seeded fuzz over the characters the rule cares about, around and across the 300-char cut."""
    rng = random.Random(13)
    pieces = ["#### ", "####", "# ", "1", "2", "0", "9", "-", ",", ".", "$", " ", "\n", "ab", "x" * 40]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 60)))
        truth = rng.choice(["12", "-1", "0.5", "1,2", "", ".", "2"]) if rng.random() < 0.5 else \
            (extract_solution(text, method) or "7")
        expected = verl_reference(text, truth, method, 0.1, 1.0)
        assert compute_score(text, truth, method, 0.1, 1.0) == expected, (text, truth)


def test_spot_values():
    assert compute_score("#### 42" + "x" * 293, "42") == 1.0 and compute_score("#### 42" + "x" * 294, "42") == 0.0
    assert compute_score("#### 1,234", "1234") == 1.0
    assert compute_score("#### 7 and later #### 8", "8") == 1.0 and compute_score("#### 7 then #### 8", "7") == 0.0
    assert compute_score("#### 72" + "." * SOLUTION_CLIP_CHARS, "72") == 0.0
    assert compute_score("#### 70", "72", format_score=0.1) == 0.1
    assert compute_score("The answer is 72.", "72", method="flexible") == 0.0  # "72." != "72", as verl
    assert extract_solution("Answer: 18 .", "flexible") == "18"


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(ValueError, match="strict, flexible"):
        extract_solution("#### 1", method="loose")


def test_embedded_arith_solutions_score_one_against_their_answer(repo_root):
    """Every embedded problem's own solution is a correct strict answer to its extracted number."""
    rows = [json.loads(line) for line in (repo_root / "data/arith/train.jsonl").read_text().splitlines()[:200]]
    truths = [r["answer"].rsplit("#### ", 1)[1].replace(",", "").strip() for r in rows]
    assert rows and all(compute_score(r["answer"], t) == 1.0 for r, t in zip(rows, truths))


def test_every_real_gsm8k_solution_scores_one_against_verls_ground_truth(gsm8k_train):
    """verl's data script takes the number after the first '#### ' (commas removed) as the ground truth."""
    rows = [json.loads(line) for line in gsm8k_train.read_text().splitlines()]
    truths = [re.search(r"#### (-?[0-9.,]+)", r["answer"]).group(1).replace(",", "") for r in rows]
    assert all(compute_score(r["answer"], t) == 1.0 for r, t in zip(rows, truths))
    assert all(compute_score(r["answer"], t) == verl_reference(r["answer"], t) for r, t in zip(rows, truths))
