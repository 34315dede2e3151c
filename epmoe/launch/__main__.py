import sys

from epmoe.launch.cli import main

sys.exit(main())
