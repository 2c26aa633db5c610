"""`python -m slimspec_operator`: run the operator."""

from __future__ import annotations

import sys

from slimspec_operator.main import main

if __name__ == "__main__":
    sys.exit(main())
