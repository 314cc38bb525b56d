"""``python -m reports summarise DIR`` (see :mod:`reports.cli`)."""

import sys

from reports.cli import main

sys.exit(main())
