"""The embedded arithmetic data: the generator reproduces the committed file byte for byte, and every
answer's steps evaluate to the '#### n' it ends with."""

from __future__ import annotations

import importlib.util
import json
import operator
import re

import pytest

STEP = re.compile(r"^(-?\d+) ([-+*/]) (\d+) = (-?\d+)$")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


@pytest.fixture(scope="module")
def generator(repo_root):
    path = repo_root / "data" / "arith" / "generate.py"
    spec = importlib.util.spec_from_file_location("arith_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def committed_rows(repo_root):
    return [json.loads(line) for line in (repo_root / "data/arith/train.jsonl").read_text().splitlines()]


def test_regenerates_the_committed_file_byte_for_byte(generator, repo_root, tmp_path):
    out = tmp_path / "train.jsonl"
    generator.main(["--out", str(out)])  # the defaults: n=3000, seed=0, all levels
    assert out.read_bytes() == (repo_root / "data/arith/train.jsonl").read_bytes()


@pytest.mark.parametrize("name, args", [("demo.jsonl", ["--seed", "1", "--levels", "1"]),
                                        ("levels12.jsonl", ["--seed", "2", "--levels", "1,2"])])
def test_the_presets_files_are_regenerated_by_their_readme_commands(generator, repo_root, tmp_path, name, args):
    """data/arith/README.md's table: each committed file is its command's output, byte for byte."""
    out = tmp_path / name
    generator.main(["--n", "3000", *args, "--out", str(out)])
    assert out.read_bytes() == (repo_root / "data/arith" / name).read_bytes()


def test_other_seed_gives_other_problems(generator):
    assert generator.generate(20, seed=1) != generator.generate(20, seed=0)
    assert generator.generate(20, seed=1) == generator.generate(20, seed=1)


def test_every_answer_ends_in_the_value_of_its_steps(committed_rows):
    assert len(committed_rows) == 3000
    for row in committed_rows:
        *steps, final = row["answer"].split("\n")
        assert final.startswith("#### "), row
        value = None
        for line in steps:
            a, op, b, result = STEP.match(line).groups()
            a, b, result = int(a), int(b), int(result)
            if value is not None:
                assert a == value, f"step does not continue from the previous result: {row}"
            if op == "/":
                assert a % b == 0, f"division is not exact: {row}"
            assert OPS[op](a, b) == result, f"wrong arithmetic: {row}"
            value = result
        assert int(final.removeprefix("#### ")) == value, row
        assert 1 <= len(steps) <= 3


def test_levels_and_ids(committed_rows):
    levels = {row["level"] for row in committed_rows}
    assert levels == {1, 2, 3, 4}
    counts = [sum(row["level"] == lv for row in committed_rows) for lv in sorted(levels)]
    assert min(counts) > 600  # levels are drawn uniformly: about 750 each
    ids = [row["id"] for row in committed_rows]
    assert len(set(ids)) == len(ids) and ids[0] == "arith-0-0"
    # each level has the shape the generator's docstring promises
    shapes = {1: (1, 1), 2: (2, 2), 3: (2, 3), 4: (3, 3)}
    for row in committed_rows:
        steps = row["answer"].split("\n")[:-1]
        low, high = shapes[row["level"]]
        assert low <= len(steps) <= high, row
        if row["level"] >= 3:
            assert any(" * " in s for s in steps), row
