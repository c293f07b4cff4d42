"""python -m conveyor.bench gmm [--reps N] [--out FILE]"""

import sys

from conveyor.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
