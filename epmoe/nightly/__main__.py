import sys

from epmoe.nightly.cli import main

sys.exit(main())
