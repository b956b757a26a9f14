"""`python -m lmprog ...` is the `lmprog` command (see `lmprog.cli`)."""

from __future__ import annotations

import sys

from lmprog.cli import main

sys.exit(main())
