"""Reading only the rows a stage needs."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core.io.tables import rows_with_ids


def test_rows_with_ids_keeps_file_order_and_skips_unknown_ids(tmp_path):
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt_id": ["a", "b", "c", "d"], "x": [1, 2, 3, 4], "y": [5, 6, 7, 8]}), path)
    rows = rows_with_ids(path, "prompt_id", ["d", "b", "zzz", "b"], columns=["prompt_id", "x"])
    assert rows == [{"prompt_id": "b", "x": 2}, {"prompt_id": "d", "x": 4}]
    assert rows_with_ids(path, "prompt_id", []) == []
    assert rows_with_ids(path, "prompt_id", ["a"])[0] == {"prompt_id": "a", "x": 1, "y": 5}
