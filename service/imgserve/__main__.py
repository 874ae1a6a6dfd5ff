"""`python -m imgserve ...`: the same as the `imgserve` command."""

import sys

from imgserve.cli import main

sys.exit(main())
