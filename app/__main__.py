"""python -m app: open the window and load the last (or default) model in the background.

python -m app --selftest [...] answers one prompt without Qt (app.selftest), for launchers and support.
"""

import sys

if "--selftest" in sys.argv[1:]:
    from .selftest import main as selftest

    sys.exit(selftest([a for a in sys.argv[1:] if a != "--selftest"]))

from .main import main  # noqa: E402 - Qt is imported only when the window is wanted

sys.exit(main())
