"""A checkpoint's sha256 manifest: whatever happened to manifest.json itself, verifying is one
CheckpointError naming it (a byte that is not UTF-8, or a "files" that is not a mapping of records,
escaped as UnicodeDecodeError / AttributeError out of `rlhf status`, a resume and an export)."""

from __future__ import annotations

import pytest

from rlhf_core.errors import CheckpointError
from rlhf_core.io.checksums import verify_checkpoint, write_checksums


@pytest.mark.parametrize("damage", [b'{"files": "\xff"}', b"{torn", b"[1, 2]", b'{"files": [1]}',
                                    b'{"files": {"w.bin": 5}}', b'{"files": {"w.bin": {"bytes": "4"}}}'],
                         ids=["bytes", "torn", "list", "files_list", "entry", "entry_types"])
def test_a_damaged_checkpoint_manifest_is_one_error_naming_it(tmp_path, damage):
    (tmp_path / "w.bin").write_bytes(b"1234")
    write_checksums(tmp_path)
    assert set(verify_checkpoint(tmp_path)["files"]) == {"w.bin"}
    (tmp_path / "manifest.json").write_bytes(damage)
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'manifest.json'} is corrupt \(.*\); rerun the update"):
        verify_checkpoint(tmp_path)
