"""The run directory's small text files read back whatever happened to them: a damaged JSON state
file is one StateFileError naming it, a damaged events line is skipped and named once."""

from __future__ import annotations

import json

import pytest

from rlhf_core.run import layout
from rlhf_core.run.layout import RunDir, StateFileError
from rlhf_core.run.manifest import read_manifest, record_stage


@pytest.fixture
def run(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    return run


@pytest.mark.parametrize("damage,said", [
    (b"\xff\xfe", r"is damaged \(not JSON: 'utf-8' codec can't decode"), (b"{torn", r"is damaged \(not JSON: "),
    (b"[1]", r"is damaged \(it holds a list, not a JSON object\)"), (b"null", r"is damaged \(it holds null"),
    (b'"text"', r"is damaged \(it holds a string"), (b"[" * 100_000, r"is damaged \(not JSON: maximum recursion"),
])
def test_a_damaged_state_file_is_one_error_naming_it(run, damage, said):
    path = run.root / "state.json"
    path.write_bytes(damage)
    with pytest.raises(StateFileError, match=rf"^{path} {said}"):
        run.read_json(path)
    assert run.read_json(run.root / "absent.json", default={}) == {}


def test_a_manifest_record_that_is_not_an_object_is_damage(run):
    record_stage(run, 1, "score", status="done")
    manifest = json.loads(run.manifest_path(1).read_text())
    run.manifest_path(1).write_text(json.dumps({**manifest, "gae": 5}))
    with pytest.raises(StateFileError, match=r"iter_1/manifest.json is damaged \(the record of 'gae' is a number, not a JSON object\)"):
        read_manifest(run, 1)


def test_damaged_event_lines_are_skipped_and_named_once(run, capsys, monkeypatch):
    """Issue 38: one byte that is not UTF-8 made every reader of events.jsonl raise."""
    monkeypatch.setattr(layout, "_WARNED", set())
    run.append_event("first", 1)
    with open(run.events_path, "ab") as fh:
        fh.write(b'{"kind": "caf\xe9"}\n[1, 2]\n\n{"kind": "fine"}\n')
    run.append_event("last", 2)
    assert [e["kind"] for e in run.events()] == ["first", "fine", "last"]
    assert [e["kind"] for e in run.events()] == ["first", "fine", "last"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err  # said once per process
    assert err[0].startswith(f"rlhf: warning: {run.events_path} line 2 and 1 more line damaged (UnicodeDecodeError")


def test_an_event_after_a_torn_line_starts_a_line_of_its_own(run, monkeypatch):
    monkeypatch.setattr(layout, "_WARNED", set())
    run.append_event("first", 1)
    with open(run.events_path, "ab") as fh:
        fh.write(b'{"kind": "half')  # a writer killed mid-append
    run.append_event("next", 2)
    assert [e["kind"] for e in run.events()] == ["first", "next"]
