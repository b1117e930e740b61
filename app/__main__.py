"""python -m app: open the window and load the last (or default) model in the background."""

import sys

from .main import main

sys.exit(main())
