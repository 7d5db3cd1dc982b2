"""`python -m dsml` is the `dsml` command."""

import sys

from .cli import main

sys.exit(main())
