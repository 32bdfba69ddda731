"""`python -m natsfs` is the `natsfs` command."""

import sys

from .cli import main

sys.exit(main())
