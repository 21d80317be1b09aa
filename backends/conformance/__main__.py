import sys

from sixfold.backends.conformance.cli import main

sys.exit(main())
