import sys

from replaymoe.apps.cli import main

sys.exit(main())
