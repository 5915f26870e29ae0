"""Progress lines of the data tools on stderr: documents so far, documents/s, MB/s, tokens/s (when the
tool counts tokens), the share of the input done and the ETA; the last line starts with "done: ".

    progress = Progress(total_bytes)
    progress.report(docs, nbytes, position, tokens)               # 1,000 docs | 950 docs/s | ... | ETA 12s
    progress.report(docs, nbytes, position, tokens, final=True)   # done: ...
"""
from __future__ import annotations

import sys
import time
from typing import Optional


class Progress:
    """Rates since the tool started; the share done is `position` out of `total` bytes of input. A line
    starts with `prefix`, the final one by default with "done: "."""

    def __init__(self, total: int) -> None:
        self.total, self.start = total, time.time()

    @property
    def elapsed(self) -> float:
        return max(time.time() - self.start, 1e-9)

    def report(self, docs: int, nbytes: int, position: int, tokens: Optional[int] = None, final: bool = False,
               prefix: str = "") -> None:
        elapsed = self.elapsed
        line = f"{docs:,} docs | {docs / elapsed:,.0f} docs/s | {nbytes / elapsed / 1e6:,.2f} MB/s"
        if tokens is not None:
            line += f" | {tokens / elapsed:,.0f} tokens/s"
        if self.total and not final:
            frac = min(position / self.total, 1.0)
            eta = elapsed * (1 - frac) / frac if frac > 0 else float("nan")
            line += f" | {100 * frac:.1f}% | ETA {eta:,.0f}s"
        head = prefix or ("done: " if final else "")
        print(head + line + f" | {elapsed:,.1f}s", file=sys.stderr, flush=True)
