"""Progress bars for the long conversion steps (tensor reads, calibration, per-layer searches).

tqdm when it is installed (it is not a dependency of tinyvila), else one line on stderr per 10%.
"""

from __future__ import annotations

import sys


class Progress:
    """`update(n)` / `close()` over a known total; usable as a context manager."""

    def __init__(self, total: int, desc: str, unit: str = "tensor"):
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit=unit)
        except ImportError:
            self.bar = None
        self.total, self.desc, self.unit, self.n, self.shown = total, desc, unit, 0, -1

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
            return
        tenth = 10 * self.n // max(self.total, 1)
        if tenth != self.shown:
            self.shown = tenth
            print(f"{self.desc}: {self.n}/{self.total} {self.unit}s", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
