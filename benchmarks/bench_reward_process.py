"""What running custom_reward_function.path's function in a process of its own costs the score stage.

    python benchmarks/bench_reward_process.py [--rows 64 256] [--repeats 5]

The score stage's own reward loop (``rewards.sequence.rule_rewards``) on GSM8K-style responses to the
demo's prompts (data/arith/train.jsonl, half of them right), three ways:

  built-in    configs/demo.yaml as it is: the built-in GSM8K rule, in the run's process (the demo's
              path, which the user-process change must leave as it was)
  in-process  a user's function (verl's signature, a dict result with numpy values) registered with
              @register_reward: called in the run's process, as every user function was before
  own process the same function named by custom_reward_function.path: its module imported in a
              child process, every call a round trip over a pipe (``rewards.user_process``)

Prints the median wall time of each (the own-process one split, in separate repetitions, into the
child's start and the calls),
the ratio own-process / in-process, and checks that the scores, reward_extra and acc columns of the
last two are identical (bit for bit: the floats compared with ==, the JSON text as text).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TQDM_DISABLE", "1")  # the score loop's bar, as `rlhf run` hides it
sys.path.insert(0, str(REPO))

from arguments import positive_int  # noqa: E402  (stdlib only: the score stage is imported after the arguments)

if TYPE_CHECKING:
    from rlhf_core.rewards.sequence import RewardSettings

USER = textwrap.dedent("""
    import re
    import numpy as np

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        found = re.findall(r"#### (-?[0-9.,]+)", solution_str)
        pred = found[-1].replace(",", "") if found else None
        right = pred == str(ground_truth)
        return {"score": np.float32(1.0 if right else 0.1), "acc": np.bool_(right), "pred": pred,
                "index": (extra_info or {}).get("index")}
""")


def _rows(n: int) -> tuple[list[dict], dict[str, dict]]:
    """n rollout-table rows (every column the reward loop reads) and their prompts."""
    source = [json.loads(line) for line in (REPO / "data" / "arith" / "train.jsonl").read_text().splitlines()]
    rows, prompts = [], {}
    for i in range(n):
        item = source[i % len(source)]
        answer = item["answer"].rsplit("####", 1)[-1].strip()
        said = answer if i % 2 == 0 else answer + "1"
        pid = f"p{i}"
        prompts[pid] = {"prompt_id": pid, "prompt": item["question"], "extra_info": json.dumps({"index": i}),
                        "reward_source": "arith"}
        rows.append({"prompt_id": pid, "sample_index": 0, "reward_source": "arith", "ground_truth": answer,
                     "extra_info": json.dumps({"index": i}),
                     "response_text": f"Let me work it out step by step. #### {said}"})
    return rows, prompts


def _time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), out


def _split(settings: RewardSettings, rows: list[dict], repeats: int) -> tuple[float, float]:
    """(median start of the function's process, median time of its calls on ``rows``), measured in the
    same repetitions: the start is the import of the user's module in a fresh child."""
    from rlhf_core.rewards import registry

    starts, calls = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        fn = registry.UserReward(settings.reward_function)
        ready = time.perf_counter()
        for r in rows:
            fn(r["reward_source"], r["response_text"], r["ground_truth"], r["extra_info"])
        calls.append(time.perf_counter() - ready)
        starts.append(ready - started)
        fn.close()
    return statistics.median(starts), statistics.median(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=positive_int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=positive_int, default=5)
    args = parser.parse_args()
    from rlhf_core.config import load_config
    from rlhf_core.config.reads import build
    from rlhf_core.rewards import registry
    from rlhf_core.rewards.sequence import rule_rewards
    from rlhf_core.stages.settings import reward_settings

    work = Path(tempfile.mkdtemp(prefix="bench-reward-"))
    user_file = work / "my_reward.py"
    user_file.write_text(USER)
    sys.path.insert(0, str(work))
    import my_reward  # noqa: PLC0415  the user's module, in this process for the in-process way

    demo = build(reward_settings, load_config(REPO / "configs" / "demo.yaml", []))
    custom = build(reward_settings, load_config(REPO / "configs" / "demo.yaml",
                                                [f"custom_reward_function.path={user_file}"]))
    where = work / "rollout.parquet"
    print(f"{'rows':>5} {'built-in':>10} {'in-process':>11} {'own process':>12} {'(start':>8} {'calls)':>8} "
          f"{'per call':>9} {'ratio':>6}  identical")
    for n in args.rows:
        rows, prompts = _rows(n)
        builtin_s, _ = _time(lambda: rule_rewards(demo, rows, prompts, where), args.repeats)
        registry.REWARDS.register("arith")(my_reward.compute_score)
        try:
            inproc_s, inproc = _time(lambda: rule_rewards(demo, rows, prompts, where), args.repeats)
        finally:
            registry.REWARDS.unregister("arith")
        own_s, own = _time(lambda: rule_rewards(custom, rows, prompts, where), args.repeats)
        start_s, calls_s = _split(custom, rows, args.repeats)
        same = inproc == own
        print(f"{n:>5} {builtin_s * 1e3:>8.1f}ms {inproc_s * 1e3:>9.1f}ms {own_s * 1e3:>10.0f}ms {start_s * 1e3:>6.0f}ms "
              f"{calls_s * 1e3:>6.0f}ms {calls_s / n * 1e6:>7.0f}us {own_s / inproc_s:>6.0f}  {same}")
        if not same:
            raise SystemExit("the own-process results differ from the in-process ones")


if __name__ == "__main__":
    main()
