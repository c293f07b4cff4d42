"""Progress bars of long work (`conveyor check`, benchmarks): tqdm on stderr, or nothing.

tqdm is imported only when a bar is drawn, so the library imports where only the source tree is
present (the GPU machines run Conveyor from src/ on their preinstalled packages).
"""

from __future__ import annotations

import sys


class _Silent:
    """The no-bar stand-in: counts nothing, still prints finished rows."""

    def update(self, n: int = 1) -> None:
        pass

    def write(self, line: str) -> None:
        print(line, flush=True)

    def close(self) -> None:
        pass


def bar(total: int, desc: str, unit: str, enabled: bool | None = None):
    """A progress bar to `update(n)`, `write(line)` above and `close()`.

    enabled: True / False, or None for "when stderr is a terminal" (logs stay clean).
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return _Silent()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False)
