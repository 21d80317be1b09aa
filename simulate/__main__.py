import sys

from sixfold.simulate.cli import main

sys.exit(main())
