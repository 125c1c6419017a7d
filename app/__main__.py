"""`python -m app`: the same as the `sluice` command."""

from app.cli import main

raise SystemExit(main())
