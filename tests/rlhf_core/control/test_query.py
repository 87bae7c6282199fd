"""DuckDB views over a whole run, and the status table, on a hand-built two-iteration run."""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pytest

from rlhf_core.control import query, status
from rlhf_core.data import schemas
from rlhf_core.io.checksums import write_checksums
from rlhf_core.io.atomic import atomic_write_json, atomic_write_parquet
from rlhf_core.run.manifest import record_stage
from rlhf_core.run.lifecycle import commit_iteration as write_last_good
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.run.manifest import mark_skipped

PROMPTS = ["p0", "p1", "p2"]
# reward per (iteration, prompt): p2 is never solved; p0 is solved in both iterations
REWARD = {1: {"p0": 1.0, "p1": 0.0, "p2": 0.0}, 2: {"p0": 1.0, "p1": 1.0, "p2": 0.0}}
# old − ref per token: p1's KL grows the most from iteration 1 to 2
KL = {1: {"p0": 0.01, "p1": 0.02, "p2": 0.00}, 2: {"p0": 0.02, "p1": 0.30, "p2": 0.05}}


def _prompts_table(split):
    rows = [{"prompt_id": p, "data_source": "arith", "prompt": [{"role": "user", "content": f"q {p}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": "1"},
             "extra_info": json.dumps({"split": split, "index": i, "question": f"q {p}", "answer": "#### 1"}),
             "reward_source": "arith", "source_file": "x.jsonl", "source_row": i,
             "prompt_text": f"q {p}", "prompt_token_ids": [1, 2, 3], "prompt_length": 3}
            for i, p in enumerate(PROMPTS if split == "train" else ["v0"])]
    return pa.Table.from_pylist(rows, schema=schemas.PROMPTS)


def _scored_rows(k):
    rows = []
    for p in PROMPTS:
        old = [-1.0, -2.0]
        rows.append({"prompt_id": p, "sample_index": 0, "iteration": k, "data_source": "arith", "ground_truth": "1",
                     "prompt_token_ids": [1, 2, 3], "response_text": f"answer {p}", "response_token_ids": [4, 5],
                     "response_length": 2, "finish_reason": "stop", "engine": "hf", "sampling_seed": 7,
                     "reward_source": "arith", "extra_info": json.dumps({"question": f"q {p}"}), "uid": f"{k}-{p}", "rollout_log_probs": old,
                     "reward": REWARD[k][p], "reward_extra": "{}", "old_log_probs": old,
                     "ref_log_probs": [o - KL[k][p] for o in old], "values": [0.1, 0.2], "reward_baseline": None,
                     "sum_pi_squared": None,
                     "token_level_rewards": [0.0, REWARD[k][p]], "advantages": [0.5, 0.5], "returns": [1.0, 1.0],
                     "rollout_is_weights": None, "response_mask": None})
    return rows


@pytest.fixture
def run(tmp_path):
    run = RunDir(tmp_path / "run")
    atomic_write_parquet(run.train_prompts, _prompts_table("train"), schema=schemas.PROMPTS)
    atomic_write_parquet(run.val_prompts, _prompts_table("val"), schema=schemas.PROMPTS)
    write_config(run, "{}\n")
    for k in (1, 2):
        rows = _scored_rows(k)
        atomic_write_parquet(run.rollout(k), pa.Table.from_pylist(rows).select(schemas.ROLLOUT.names),
                             schema=schemas.ROLLOUT)
        atomic_write_parquet(run.scored(k), pa.Table.from_pylist(rows).select(schemas.SCORED.names),
                             schema=schemas.SCORED)
        atomic_write_parquet(run.advantages(k), pa.Table.from_pylist(rows), schema=schemas.ADVANTAGES)
        atomic_write_json(run.metrics(k), {"reward/mean": sum(REWARD[k].values()) / 3, "kl/mean": 0.01 * k,
                                           "actor/pg_clipfrac": 0.2, "iteration": float(k)})
        for stage in ("rollout", "score", "gae", "update", "guard"):
            record_stage(run, k, stage, status="done", inputs={}, outputs={}, config_hash="h", seconds=1.0,
                         metrics={"x": 1.0})
    run.checkpoint(1).joinpath("actor").mkdir(parents=True)
    run.checkpoint(1).joinpath("actor", "model.safetensors").write_bytes(b"weights")
    write_checksums(run.checkpoint(1))  # sealed, as the update seals it: status verifies it
    write_last_good(run, 1)
    run.append_event("rollback", 2, kl=0.3, threshold=0.05, attempt=1)
    return run


def test_views_span_every_iteration(run):
    con = query.connect(run)
    try:
        names = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        assert set(query.VIEW_NAMES) <= names
        assert con.execute("SELECT count(*), count(DISTINCT iteration) FROM scored").fetchone() == (6, 2)
        assert con.execute("SELECT count(*) FROM rollouts").fetchone()[0] == 6
        assert con.execute("SELECT count(*) FROM advantages WHERE iteration = 2").fetchone()[0] == 3
        assert con.execute("SELECT split, count(*) FROM prompts GROUP BY 1 ORDER BY 1").fetchall() == [
            ("train", 3), ("val", 1)]
        assert con.execute("SELECT count(*) FROM validation").fetchone()[0] == 0  # empty, but queryable
        event = con.execute("SELECT kind, iteration, details FROM events WHERE kind != 'commit'").fetchone()
        assert event[:2] == ("rollback", 2) and json.loads(event[2])["kl"] == 0.3
    finally:
        con.close()


def test_reward_by_iteration(run):
    table = query.query(run, "SELECT iteration, avg(reward) AS reward FROM scored GROUP BY 1 ORDER BY 1")
    assert table.to_pylist() == [{"iteration": 1, "reward": pytest.approx(1 / 3)},
                                 {"iteration": 2, "reward": pytest.approx(2 / 3)}]


def test_responses_whose_kl_grew_most(run):
    sql = """SELECT b.prompt_id, b.kl - a.kl AS growth FROM response_kl a JOIN response_kl b
             USING (prompt_id, sample_index) WHERE a.iteration = 1 AND b.iteration = 2 ORDER BY growth DESC"""
    rows = query.query(run, sql).to_pylist()
    assert rows[0]["prompt_id"] == "p1" and rows[0]["growth"] == pytest.approx(0.28, abs=1e-5)


def test_prompts_never_solved(run):
    sql = """SELECT p.prompt_id FROM prompts p LEFT JOIN scored s ON s.prompt_id = p.prompt_id
             WHERE p.split = 'train' GROUP BY 1 HAVING coalesce(max(s.reward), 0) < 1 ORDER BY 1"""
    assert query.query(run, sql).column("prompt_id").to_pylist() == ["p2"]


def test_metrics_long_and_wide(run):
    assert query.query(run, "SELECT value FROM metrics WHERE name = 'kl/mean' ORDER BY iteration") \
        .column("value").to_pylist() == [0.01, 0.02]
    wide = query.query(run, 'SELECT iteration, "reward/mean" FROM metrics_wide ORDER BY 1').to_pylist()
    assert [r["iteration"] for r in wide] == [1, 2]


def test_an_empty_run_directory_is_queryable(tmp_path):
    empty = RunDir(tmp_path / "empty")
    empty.root.mkdir()
    assert query.query(empty, "SELECT count(*) AS n FROM scored").column("n").to_pylist() == [0]
    assert status.status_table(empty) == []
    assert "last-good: none" in status.format_status(empty)


def test_status_table_states(run):
    from rlhf_core.run.manifest import mark_downstream_stale, set_status

    time.sleep(0.01)
    mark_skipped(run, 2, "rollout")
    mark_downstream_stale(run, 2, "score")  # gae, update, guard of iteration 2 go stale
    set_status(run, 2, "guard", "rolled_back")
    rows = {r["iteration"]: r for r in status.status_table(run)}
    assert rows[1]["guard"] == "committed" and rows[1]["last_good"] and rows[1]["checkpoint"]
    assert rows[2]["rollout"] == "skipped" and rows[2]["score"] == "done"
    assert rows[2]["gae"] == "stale" and rows[2]["guard"] == "rolled_back" and rows[2]["rollbacks"] == 1
    assert rows[2]["reward"] == pytest.approx(2 / 3) and not rows[2]["checkpoint"]
    text = status.format_status(run)
    assert "last-good: iteration 1 (iter_1/checkpoint)" in text and "rolled_back" in text
    weights = run.checkpoint(1) / "actor" / "model.safetensors"
    weights.write_bytes(b"weighty")  # damaged: never called last-good, and the problem says what a resume does
    rows = {r["iteration"]: r for r in status.status_table(run)}
    assert rows[1]["checkpoint_damaged"]
    text = status.format_status(run)
    [row] = [line.split() for line in text.splitlines() if line.split()[:1] == ["1"]]
    assert "last-good: iteration" not in text and row[-1] == "damaged"
    assert f"problem: iter_1/checkpoint is damaged (checkpoint file {weights} is corrupt: its sha256 does not " \
           f"match {run.checkpoint(1) / 'manifest.json'}); a resume rebuilds it by replaying iteration 1's update" in text


def test_format_table_truncates():
    table = pa.table({"a": list(range(5)), "b": ["x" * 100] * 5})
    text = query.format_table(table, max_rows=2, max_width=10)
    assert "... 3 more rows" in text and "(5 rows)" in text and "x" * 10 not in text


def test_iteration_zero_is_the_initial_policys_validation(run):
    """The baseline every later val/accuracy is read against shows up as iteration 0 of the metrics
    views (and so of the learning curve), from the validate stage's manifest record."""
    record_stage(run, 0, "validate", status="done", inputs={}, outputs={}, config_hash="h", seconds=1.0,
                 metrics={"val/accuracy": 0.3125})
    rows = query.query(run, "SELECT iteration, value FROM metrics WHERE name = 'val/accuracy'").to_pylist()
    assert rows == [{"iteration": 0, "value": 0.3125}]
    wide = query.query(run, 'SELECT iteration FROM metrics_wide ORDER BY 1').column("iteration").to_pylist()
    assert wide == [0, 1, 2]


def test_event_and_stage_times_are_timestamps_shown_as_dates(run, capsys):
    """Issue 29: events.time showed as 1.79628e+09 in `rlhf query`. Times are timestamps now: SQL
    compares them with dates, and the CLI prints them to the second."""
    import re

    from rlhf_cli.main import main

    assert main(["query", str(run.root), "SELECT time, kind FROM events WHERE time > now() - INTERVAL 1 DAY "
                                         "AND kind = 'rollback'"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^20\d\d-\d\d-\d\d \d\d:\d\d:\d\d\+00:00  rollback", out, re.M) and "e+09" not in out, out
    started = query.query(run, "SELECT min(started_at) AS s FROM stages WHERE started_at IS NOT NULL")
    assert str(started.schema.field("s").type).startswith("timestamp")


def test_status_shows_the_latest_iterations_time_against_its_floor(run):
    """Each stage's seconds beside its floor (model FLOPs at the measured matmul rate) and how many times
    the floor it took, from the iteration's metrics as the report collects them; verl's throughput and
    MFU beside."""
    from rlhf_core.config.schema import DataConfig
    from rlhf_core.run.report import iteration_metrics

    assert "time against floor" not in status.format_status(run)  # nothing reported floors yet
    seconds_floor = {"rollout": (4.0, 0.5), "score": (1.0, 0.4), "update": (6.0, 3.0), "guard": (0.5, 0.25)}
    for stage, (seconds, floor) in seconds_floor.items():
        record_stage(run, 2, stage, status="done", inputs={}, outputs={}, config_hash="h", seconds=seconds,
                     metrics={f"perf/stage_floor_seconds/{stage}": floor, "perf/device_matmul_flops_per_s": 1.6e11,
                              **({"perf/mfu/actor": 0.31, "perf/mfu/critic": 0.29} if stage == "update" else {})})
    metrics = iteration_metrics(DataConfig(), run, 2)
    assert metrics["perf/stage_over_floor/rollout"] == 8.0 and metrics["perf/stage_over_floor/guard"] == 2.0
    assert "perf/stage_over_floor/gae" not in metrics  # no model pass, no floor
    # verl's compute_throughout_metrics: the batch's prompt + response tokens over the step's seconds
    assert metrics["perf/total_num_tokens"] == 15.0 and metrics["timing_s/step"] == 12.5
    assert metrics["perf/time_per_step"] == 12.5 and metrics["perf/throughput"] == pytest.approx(15 / 12.5)

    lines = status.format_status(run).splitlines()
    start = lines.index("time against floor, iteration 2 (device matmul 160.0 GFLOP/s); verl's perf/mfu: "
                        "actor 0.310, critic 0.290:")
    table = {line.split()[0]: line.split()[1:] for line in lines[start + 3:start + 8]}
    assert table["rollout"] == ["4", "0.5", "8"] and table["update"] == ["6", "3", "2"]
    assert table["gae"] == ["1", "-", "-"]


def _accuracy(prefix: str, correct: int, n: int = 256) -> dict:
    from rlhf_core.stages.validate import wilson_interval

    low, high = wilson_interval(correct, n)
    return {f"{prefix}/accuracy": correct / n, f"{prefix}/accuracy_ci_low": low, f"{prefix}/accuracy_ci_high": high}


def test_status_and_the_closing_block_show_accuracy_before_and_after_the_warm_start_and_the_latest(run):
    """The landmarks a run is judged by, each with its 95 % interval: the model before the SFT, the
    initial (warm-started) policy, the latest validation."""
    from rlhf_cli.orchestrated import closing_block

    assert status.accuracy_lines(run) == []  # no validation yet
    record_stage(run, 0, "validate", status="done", inputs={}, outputs={}, config_hash="h", seconds=1.0,
                 metrics={**_accuracy("val_base", 2), **_accuracy("val", 30), "val/num_prompts": 256.0})
    atomic_write_json(run.iteration_metrics(2), {**_accuracy("val", 90), "val/num_prompts": 256.0})
    lines = status.accuracy_lines(run)
    assert lines[0] == "held-out accuracy (256 validation prompts; 95 % interval):"
    assert [line.split()[:3] for line in lines[1:]] == [["before", "the", "warm"], ["iteration", "0", "(after"],
                                                       ["iteration", "2", "0.352"]]
    assert "0.008 [0.002, 0.028]" in lines[1] and "0.117 [0.083, 0.162]" in lines[2]
    assert "\n".join(lines) in status.format_status(run)
    summary = {"run_dir": str(run.root), "last_good": {"iteration": 2}, "export": None}
    assert "\n".join(lines) in closing_block(summary)


def test_without_a_warm_start_the_first_line_is_the_initial_policy(run):
    record_stage(run, 0, "validate", status="done", inputs={}, outputs={}, config_hash="h", seconds=1.0,
                 metrics={**_accuracy("val", 30), "val/num_prompts": 256.0})
    lines = status.accuracy_lines(run)
    assert len(lines) == 2 and lines[1].split()[:4] == ["iteration", "0", "(the", "initial"]
