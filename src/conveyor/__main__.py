"""python -m conveyor ... (same as the `conveyor` command)."""

import sys

from conveyor.cli import main

sys.exit(main())
