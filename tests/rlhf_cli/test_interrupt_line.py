"""The Ctrl-C line stands on its own line when a progress bar is drawn (it was glued to the bar's
text: tqdm draws without ending its line)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, signal, time
    from tqdm import tqdm
    from rlhf_cli import main
    main._on_ctrl_c("stage")
    bar = tqdm(total=10, desc="rollout", disable={disabled})
    bar.update(3)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
""")


@pytest.mark.parametrize("disabled", [False, True], ids=["bar-drawn", "no-bar"])
def test_the_interrupt_line_starts_its_own_line(disabled):
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(disabled=disabled)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode in (-signal.SIGINT, 130), out.stderr[-2000:]  # the interrupt ends the script
    lines = out.stderr.replace("\r", "\n").splitlines()
    assert "rlhf: interrupted" in lines, out.stderr
    assert ("rollout" in out.stderr) is not disabled
    assert out.stderr.endswith("rlhf: interrupted\n") and "\n\n" not in out.stderr.lstrip("\n"), repr(out.stderr)
