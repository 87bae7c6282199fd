"""Reading only the rows a stage needs from a Parquet table.

A stage that needs 64 of the 2,900 training prompts should not turn all of them into Python
objects (the chat messages and extra_info of every prompt cost ~50 ms per read on the demo): the
filter runs in Arrow, and only the matching rows are converted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rlhf_core.io.timing import TABLE_READ, timed


def rows_with_ids(path: str | Path, id_column: str, ids: Iterable[str],
                  columns: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """Rows of ``path`` whose ``id_column`` is in ``ids`` (file order; ids not in the file are
    simply absent: the caller names them in its error). ``columns`` None = every column."""
    wanted = pa.array(sorted(set(ids)), type=pa.string())
    with timed(TABLE_READ):
        table = pq.read_table(path, columns=list(columns) if columns is not None else None)
        return table.filter(pc.is_in(table[id_column], value_set=wanted)).to_pylist()
