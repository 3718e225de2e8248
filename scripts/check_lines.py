"""Line budget: fails when the runtime outgrows the size docs/design.md sets for it.

Counted: non-empty lines (any non-whitespace character; comments and docstrings included) of every *.py
file under tinyvila/ (tinyvila/convert/, the checkpoint converters, and tinyvila/serve/, the HTTP server, excluded:
optional front ends with their own extras that the runtime never imports) and under csrc_triton/.
Run from the repo root: python -m scripts.check_lines (exit status 1 when a tree is over its budget).
"""

import sys
from pathlib import Path

# The budgets: set in docs/design.md, changed only together with it.
TINYVILA_BUDGET = 6421
CSRC_TRITON_BUDGET = 5130

ROOT = Path(__file__).resolve().parents[1]
TREES = [("tinyvila", TINYVILA_BUDGET, ["tinyvila/convert", "tinyvila/serve"]), ("csrc_triton", CSRC_TRITON_BUDGET, [])]


def count_lines(tree: str, exclude: list[str]) -> int:
    """Non-empty lines of the *.py files under ROOT/tree, none under an excluded folder."""
    skip = [ROOT / e for e in exclude]
    files = [p for p in (ROOT / tree).rglob("*.py") if not any(p.is_relative_to(s) for s in skip)]
    return sum(1 for p in files for line in p.read_text(encoding="utf-8").splitlines() if line.strip())


def main() -> int:
    over = []
    for tree, budget, exclude in TREES:
        n = count_lines(tree, exclude)
        note = "".join(f", {e}/ excluded" for e in exclude)
        print(f"{tree}/: {n} non-empty lines of Python, budget {budget}{note}")
        if n > budget:
            over.append(f"{tree}/ is {n - budget} lines over its budget of {budget}")
    for msg in over:
        print(f"line budget exceeded: {msg} (docs/design.md; shrink the code or change the budget there)")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
