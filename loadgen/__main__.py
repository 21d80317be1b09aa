"""``python -m sixfold.loadgen`` is ``sixfold-loadgen``."""

import sys

from sixfold.loadgen.cli import main

sys.exit(main())
