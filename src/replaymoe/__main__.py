import sys

from replaymoe.cli import main

sys.exit(main())
