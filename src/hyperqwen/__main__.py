"""`python -m hyperqwen ...` is the `hyperqwen` command (for a venv whose bin/ is not on PATH)."""

import sys

from hyperqwen.cli import main

sys.exit(main())
