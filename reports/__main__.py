"""``python -m reports summarise DIR`` and ``python -m reports accuracy ...`` (see :mod:`reports.cli`)."""

import sys

from reports.cli import main

sys.exit(main())
