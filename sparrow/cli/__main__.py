"""`python -m sparrow.cli`: the `sparrow` command."""

import sys

from sparrow.cli import main

sys.exit(main())
