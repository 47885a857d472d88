"""``python -m benchmarks.gpucheck --out DIR [--quick] [--only a,b]``: the package docstring says what it checks."""

from __future__ import annotations

import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main())
