"""Run-directory text files that may be damaged never cause a traceback (issue 38), through the real
command line on copies of one finished two-iteration tiny run:

- a damaged line of events.jsonl (one non-UTF-8 byte, text that is not JSON) is named in one warning
  line and skipped by `rlhf status`, `rlhf run --resume` and `rlhf export`;
- a garbage run.lock with no live holder is taken over as an unreadable lease expires; a fresh one
  is refused in one line that says when it lapses;
- every small JSON state file damaged four ways (a non-UTF-8 byte, not JSON, a JSON list, an object
  of the wrong shape) leaves `rlhf status` with its own lines, never a traceback;
- a damaged format.json is answered with the format the directory's contents are in;
- a killed `rlhf export` leaves its temporary copy only until the next export.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from rlhf_cli.main import main
from rlhf_core.io.atomic import TMP_MARK
from rlhf_core.run.layout import RunDir
from rlhf_core.run.migrate import RUN_FORMAT

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

NOT_UTF8 = b'{"time": 1.0, "kind": "note", "text": "caf\xe9"}\n'


@pytest.fixture
def run(two_iterations, tmp_path) -> RunDir:
    return RunDir(shutil.copytree(two_iterations.pristine.root, tmp_path / "run", symlinks=True))


def _no_traceback(out: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def _warnings(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in out.stderr.splitlines() if line.startswith("rlhf: warning:")]


def test_a_damaged_events_line_is_named_once_and_skipped(run, rlhf):
    """Issue 38: one non-UTF-8 byte in events.jsonl made `rlhf status` and `rlhf run --resume` end in
    a UnicodeDecodeError traceback until someone edited the file (the resume here also meets a
    garbage run.lock that no one holds, and takes it over)."""
    lines = run.events_path.read_bytes().splitlines(keepends=True)
    run.events_path.write_bytes(b"".join([lines[0], NOT_UTF8, b"{not json\n", *lines[1:]]))
    kinds = [e["kind"] for e in run.events()]

    status = rlhf("status", str(run.root))
    assert status.returncode == 0, status.stderr[-3000:]
    _no_traceback(status)
    warned = _warnings(status)
    assert len(warned) == 1, status.stderr[-3000:]
    assert warned[0].startswith(f"rlhf: warning: {run.events_path} line 2 and 1 more line damaged "
                                "(UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9"), warned
    assert warned[0].endswith("; skipped, the other lines are read"), warned

    run.lock_path.write_bytes(b"\xff\xfe\x00garbage{")  # and a garbage lock no one holds: the resume takes it over
    stale = time.time() - 3600
    os.utime(run.lock_path, (stale, stale))
    resumed = rlhf("run", "--resume", str(run.root), "--iterations", "3", "trainer.logger=[console]")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _no_traceback(resumed)
    assert "last-good: iteration 3" in resumed.stdout
    assert [e["previous_holder"]["unreadable"] for e in run.events() if e["kind"] == "stale_lease_taken_over"] == [True]
    after = [e["kind"] for e in run.events()]
    assert after[:len(kinds)] == kinds and "resume" in after[len(kinds):]  # the damaged lines stay skipped
    exported = rlhf("export", str(run.root))
    assert exported.returncode == 0, exported.stderr[-3000:]
    _no_traceback(exported)


def test_a_torn_last_event_line_costs_only_itself(run):
    """A writer killed mid-append leaves a line without its newline: the next event starts a line of
    its own (it was glued onto the torn one and lost with it)."""
    with open(run.events_path, "ab") as fh:
        fh.write(b'{"time": 1.0, "kind": "tor')
    run.append_event("after_the_tear", 2)
    assert run.events()[-1]["kind"] == "after_the_tear"


def test_a_garbage_lock_with_no_live_holder_is_taken_over(run, rlhf):
    """Issue 38: random bytes in run.lock made `rlhf run --resume` and `rlhf export` end in a
    UnicodeDecodeError traceback. An unreadable lease is an unknown holder that renewed when the file
    was last written: past the lease's expiry it is taken over (an event records it), before then
    the command is refused in one line that says when it lapses."""
    run.lock_path.write_bytes(b"\xff\xfe\x00garbage{")
    stale = time.time() - 3600
    os.utime(run.lock_path, (stale, stale))
    status = rlhf("status", str(run.root))
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr[-3000:]
    exported = rlhf("export", str(run.root))
    assert exported.returncode == 0, exported.stderr[-3000:]
    _no_traceback(exported)
    taken = [e for e in run.events() if e["kind"] == "stale_lease_taken_over"]
    assert len(taken) == 1 and taken[0]["previous_holder"]["unreadable"] is True
    assert not run.lock_path.exists()  # released as any lease is

    run.lock_path.write_bytes(b"\xff\xfe\x00garbage{")  # just written: perhaps another machine's lease being made
    refused = rlhf("export", str(run.root), RLHF_RUN_LEASE_S="600")
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and f"its lease {run.lock_path} is unreadable" in errors[0], refused.stderr[-3000:]
    assert "it is taken over once 600 s old: try again in" in errors[0] and "Traceback" not in refused.stderr


@pytest.mark.parametrize("damage", [b"\xff\xfe not utf-8", b"{not json", b"[1, 2]",
                                    b'{"files": [1], "iteration": "x", "format": 3, "committed": 5, "checkpoint": 7}'],
                         ids=["byte", "text", "list", "object"])
def test_no_damaged_state_file_makes_status_raise(run, damage, capsys):
    """Every small JSON file of the run (manifests, commit log, state records, verdicts, metrics, KL
    state, format, tracking, pack summary, the checkpoints' sha256 manifests) and the lock, damaged:
    `rlhf status` (the command line's own entry, in this process) prints its lines and returns;
    nothing escapes it as an exception (a list-shaped manifest or verdict raised AttributeError, a
    checkpoint manifest with a non-UTF-8 byte UnicodeDecodeError)."""
    files = sorted(p for p in run.root.rglob("*.json") if not {"checkpoint", "export", "models"} & set(p.parts)
                   or p.relative_to(run.root).parts[1:] == ("checkpoint", "manifest.json"))
    assert len(files) >= 17, files
    pristine = {p: p.read_bytes() for p in files}
    for path in [*files, run.lock_path]:
        path.write_bytes(damage)
        code = main(["status", str(run.root)])
        err = capsys.readouterr().err
        assert code in (0, 2), (path, err[-2000:])
        assert "Traceback" not in err, (path, err[-2000:])
        if path in pristine:
            path.write_bytes(pristine[path])
        else:
            path.unlink()


def test_a_damaged_format_file_is_answered_with_the_format_of_the_contents(run, rlhf):
    """Issue 38: a format.json that did not parse was answered with advice to write {"format": 1} into
    a directory of the current format, which would have run every upgrade over it again."""
    run.format_path.write_text('{"format": "three"}\n')
    out = rlhf("status", str(run.root))
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert len(errors) == 1 and f"{run.format_path} is damaged" in errors[0], out.stderr[-3000:]
    assert (f"its contents are format {RUN_FORMAT} (it holds nothing of an older format): write "
            f"{{\"format\": {RUN_FORMAT}}} there") in errors[0], errors[0]
    run.format_path.write_bytes(b"\xff")
    assert f'write {{"format": {RUN_FORMAT}}} there' in rlhf("status", str(run.root)).stderr
    run.format_path.write_text(json.dumps({"format": RUN_FORMAT}))  # as advised
    assert rlhf("status", str(run.root)).returncode == 0


def test_a_killed_export_leaves_its_temporary_only_until_the_next_export(run, rlhf):
    """Issue 38: `rlhf export` killed while writing left export/actor.tmp-* for good (a finished run
    is never resumed, and only a resume swept temporaries)."""
    shutil.rmtree(run.exported_actor)
    killed = rlhf("export", str(run.root), RLHF_FAULT="before_rename:export/actor")
    assert killed.returncode == 137, killed.stderr[-3000:]
    left = [p.name for p in run.export_dir.iterdir() if TMP_MARK in p.name]
    assert len(left) == 1 and left[0].startswith(f"actor{TMP_MARK}"), left
    again = rlhf("export", str(run.root))
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(p.name for p in run.export_dir.iterdir()) == ["actor"]
    assert (run.exported_actor / "export.json").is_file()

