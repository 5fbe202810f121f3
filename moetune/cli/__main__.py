"""`python -m moetune.cli ARGS` runs the `moetune` command."""

import sys

from . import main

sys.exit(main())
