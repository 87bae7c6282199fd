"""The conformance step's session: write every case, let verl 0.9.1 compute its half in its own
environment (``VERL_PYTHON``: that environment's interpreter, ``make test-verl`` builds it), load
what it returned.

Without ``VERL_PYTHON`` these tests skip, saying how to run them; with ``RLHF_REQUIRE_VERL=1`` (as
``make test-verl`` sets) a missing or broken verl environment fails instead of skipping.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_core.models.tiny import build_tokenizer, default_corpus

from .cases import all_cases

HERE = Path(__file__).resolve().parent


def _verl_python() -> str:
    python = os.environ.get("VERL_PYTHON")
    if python and Path(python).is_file():
        return python
    reason = (f"VERL_PYTHON={python!r} is not an interpreter" if python else
              "VERL_PYTHON is not set: the conformance step runs with `make test-verl`, which builds verl 0.9.1's "
              "environment and sets it")
    if os.environ.get("RLHF_REQUIRE_VERL") == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    tok = build_tokenizer(default_corpus())
    tok.save_pretrained(path)
    return str(path), tok


@pytest.fixture(scope="session")
def conformance(tmp_path_factory, tokenizer):
    """(cases by id, verl's results by id)."""
    python = _verl_python()
    work = tmp_path_factory.mktemp("conformance")
    cases = all_cases(*tokenizer)
    torch.save(cases, work / "cases.pt")
    proc = subprocess.run([python, str(HERE / "verl_side.py"), str(work / "cases.pt"), str(work / "results.pt")],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"verl side failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}", pytrace=False)
    sys.stdout.write(proc.stdout)
    results = torch.load(work / "results.pt", weights_only=False)
    return {c["id"]: c for c in cases}, results


@pytest.fixture
def verl(conformance):
    """``verl(case_id)`` → (case, verl's result); a case verl raised on fails with verl's error."""
    cases, results = conformance

    def lookup(case_id: str):
        result = results[case_id]
        if "error" in result:
            pytest.fail(f"{case_id}: verl raised {result['error']} (a name verl does not have is ours: list it in "
                        f"tests/conformance/cases.py's OUR_OWN with the reason)", pytrace=False)
        return cases[case_id], result

    lookup.ids = lambda family: sorted(i for i, c in cases.items() if c["family"] == family)
    lookup.raw = lambda case_id: (cases[case_id], results[case_id])  # verl's error, if it raised, included
    return lookup
