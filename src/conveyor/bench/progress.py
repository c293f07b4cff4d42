"""Progress of long benchmarks: a bar on stderr (only on a terminal), rows written above it."""
from __future__ import annotations

from tqdm.auto import tqdm


def rows_bar(total: int, desc: str) -> tqdm:
    """A bar counting a benchmark's rows; `bar.write(row)` prints a finished row without breaking it."""
    return tqdm(total=total, desc=desc, unit="row", leave=False, disable=None)
