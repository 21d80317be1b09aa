"""``python -m loadgen`` is ``sixfold-loadgen``."""

import sys

from .cli import main

sys.exit(main())
