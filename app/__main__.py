"""`python -m app`: the same as the `sluice` command."""

import os

try:
    from app.cli import main
except KeyboardInterrupt:  # Ctrl+C while the first modules load: leave as later, without a traceback
    os.write(2, b"\nsluice: interrupted\n")
    raise SystemExit(130) from None

raise SystemExit(main())
