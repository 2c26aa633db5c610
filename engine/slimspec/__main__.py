"""`python -m slimspec ...` is the `slimspec` command."""

from slimspec.cli import main

raise SystemExit(main())
