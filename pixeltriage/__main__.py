import sys

from pixeltriage.cli import main

sys.exit(main())
