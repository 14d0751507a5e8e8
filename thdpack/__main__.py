"""``python -m thdpack`` = the ``thdpack`` command."""

import sys

from thdpack.cli import main

sys.exit(main())
