"""``python -m dspark.export`` (see :mod:`dspark.export.cli`)."""

import sys

from dspark.export.cli import main

sys.exit(main())
