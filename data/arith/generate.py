"""Deterministic generator of arithmetic word problems in GSM8K format (the embedded default data).

Each row is ``{"question": str, "answer": str, "level": int, "id": str}`` where ``answer`` holds
one line per step ("12 + 7 = 19") and ends with ``#### <number>``, exactly like GSM8K's answers, so
the same adapter, reward and tooling serve both. Difficulty levels:

    1  one addition or subtraction, numbers up to 20
    2  two steps (add / subtract), numbers up to 50
    3  two or three steps including one multiplication, numbers up to 12 × 12
    4  three steps with multiplication and exact division, larger numbers

Same seed, same file, byte for byte (the tests check the committed file against a regeneration).

    python data/arith/generate.py --n 3000 --seed 0 --out data/arith/train.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ava", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jin", "Kai", "Lea", "Max",
         "Nia", "Omar", "Pia", "Raj", "Sol", "Tess", "Uma"]
ITEMS = ["apples", "books", "coins", "pens", "stickers", "marbles", "shells", "cards", "eggs",
         "cookies", "stamps", "beads"]
MAX_NUMBER = {1: 20, 2: 50, 3: 12, 4: 30}


def _add(rng: random.Random, total: int, item: str, hi: int) -> tuple[str, str, int]:
    k = rng.randint(1, hi)
    return f"then gets {k} more {item}", f"{total} + {k} = {total + k}", total + k


def _sub(rng: random.Random, total: int, item: str, hi: int) -> tuple[str, str, int]:
    k = rng.randint(1, max(1, total - 1)) if total > 1 else 0
    return f"then gives away {k} {item}", f"{total} - {k} = {total - k}", total - k


def _mul(rng: random.Random, total: int, item: str, hi: int) -> tuple[str, str, int]:
    k = rng.randint(2, 5)
    return f"then ends up with {k} times as many {item}", f"{total} * {k} = {total * k}", total * k


def _div(rng: random.Random, total: int, item: str, hi: int) -> tuple[str, str, int] | None:
    divisors = [d for d in (2, 3, 4, 5) if total % d == 0 and total // d > 0]
    if not divisors:
        return None
    k = rng.choice(divisors)
    return (f"then shares them equally among {k} friends and keeps one share",
            f"{total} / {k} = {total // k}", total // k)


def _steps_for(level: int, rng: random.Random) -> list:
    if level == 1:
        return [rng.choice([_add, _sub])]
    if level == 2:
        return [rng.choice([_add, _sub]) for _ in range(2)]
    if level == 3:
        ops = [_mul, rng.choice([_add, _sub])] + ([rng.choice([_add, _sub])] if rng.random() < 0.5 else [])
        rng.shuffle(ops)
        return ops
    return [_mul, _div, rng.choice([_add, _sub])]


def make_problem(level: int, rng: random.Random) -> dict:
    """One problem of the given level; the answer's lines are the worked steps then '#### n'."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    hi = MAX_NUMBER[level]
    total = rng.randint(2, hi)
    clauses, lines = [f"{name} has {total} {item}"], []
    for op in _steps_for(level, rng):
        step = op(rng, total, item, hi)
        if step is None:  # division that does not come out even: add instead
            step = _add(rng, total, item, hi)
        clause, line, total = step
        clauses.append(clause)
        lines.append(line)
    question = ", ".join(clauses) + f". How many {item} does {name} have now?"
    return {"question": question[0].upper() + question[1:], "answer": "\n".join(lines + [f"#### {total}"]),
            "level": level}


def generate(n: int, seed: int = 0, levels: tuple[int, ...] = (1, 2, 3, 4)) -> list[dict]:
    """``n`` problems, levels drawn uniformly from ``levels``, deterministic in ``seed``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        row = make_problem(rng.choice(levels), rng)
        row["id"] = f"arith-{seed}-{i}"
        rows.append(row)
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=3000, help="number of problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--levels", default="1,2,3,4", help="comma-separated difficulty levels")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("train.jsonl"))
    args = parser.parse_args(argv)
    levels = tuple(int(x) for x in args.levels.split(","))
    rows = generate(args.n, args.seed, levels)
    write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} problems (levels {levels}, seed {args.seed}) to {args.out}")


if __name__ == "__main__":
    main()
