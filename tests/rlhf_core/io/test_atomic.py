"""Atomic writes: a crash at the last moment leaves the old content (or nothing), never a partial file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_core.io.atomic import (atomic_dir, atomic_write_json, atomic_write_parquet, atomic_write_text,
                                 clean_leftovers, clean_temporaries)


def test_write_and_replace(tmp_path):
    target = tmp_path / "a" / "b.json"
    atomic_write_json(target, {"x": 1})
    atomic_write_json(target, {"x": 2})
    assert target.read_text().strip().endswith("}")
    assert '"x": 2' in target.read_text()
    assert [p.name for p in target.parent.iterdir()] == ["b.json"]


def test_parquet_schema_enforced(tmp_path):
    schema = pa.schema([("a", pa.int32()), ("b", pa.string())])
    table = pa.table({"b": ["x", "y"], "a": [1, 2], "extra": [0, 0]})
    atomic_write_parquet(tmp_path / "t.parquet", table, schema=schema)
    assert pq.read_schema(tmp_path / "t.parquet").remove_metadata() == schema
    with pytest.raises(KeyError):
        atomic_write_parquet(tmp_path / "u.parquet", pa.table({"a": [1]}), schema=schema)
    assert not (tmp_path / "u.parquet").exists()


def test_failed_write_leaves_old_content(tmp_path):
    target = tmp_path / "t.txt"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "d") as tmp:
            (tmp / "f").write_text("partial")
            raise RuntimeError("boom")
    assert not (tmp_path / "d").exists()
    assert target.read_text() == "old"
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())


def _kill_at(point: str, script: str, cwd) -> int:
    env = dict(os.environ, RLHF_FAULT=point)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, cwd=cwd).returncode


def test_kill_before_rename_keeps_old_file(tmp_path):
    target = tmp_path / "out.txt"
    atomic_write_text(target, "old")
    rc = _kill_at("before_rename:out.txt", f"""
        from rlhf_core.io.atomic import atomic_write_text
        atomic_write_text({str(target)!r}, "new")
    """, tmp_path)
    assert rc == 137
    assert target.read_text() == "old"
    leftovers = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert leftovers, "the killed writer's temporary should remain for clean-up"
    clean_temporaries(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_kill_before_dir_rename_keeps_old_dir(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        (tmp / "w").write_text("old")
    rc = _kill_at("before_rename:ckpt", f"""
        from rlhf_core.io.atomic import atomic_dir
        with atomic_dir({str(target)!r}) as tmp:
            (tmp / "w").write_text("new")
    """, tmp_path)
    assert rc == 137
    assert (target / "w").read_text() == "old"
    clean_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_the_leftovers_of_one_output_go_unless_their_writer_lives(tmp_path):
    """clean_leftovers(path): a killed writer's ``path.tmp-*`` siblings (its directory and an
    ``-old`` one) go; a live writer's stays, and so do other files and other outputs' temporaries."""
    target = tmp_path / "actor"
    rc = _kill_at("before_rename:actor", f"""
        from rlhf_core.io.atomic import atomic_dir
        with atomic_dir({str(target)!r}) as tmp:
            (tmp / "w").write_text("new")
    """, tmp_path)
    assert rc == 137
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f"actor.tmp-{live.pid}-abcdef12").mkdir()  # a write in progress elsewhere
        (tmp_path / "actor.tmp-old-1234abcd").mkdir()
        (tmp_path / "critic.tmp-1-abcdef12").write_text("another output's")
        (tmp_path / "actor.json").write_text("kept")
        removed = clean_leftovers(target)
        assert len(removed) == 2 and all(p.name.startswith("actor.tmp-") for p in removed)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["actor.json", f"actor.tmp-{live.pid}-abcdef12", "critic.tmp-1-abcdef12"])
    finally:
        live.kill()
        live.wait()
    assert clean_leftovers(tmp_path / "absent" / "actor") == []
