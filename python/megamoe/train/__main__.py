"""`python -m megamoe.train --config configs/<name>.toml`: see cli.py."""

import sys

from .cli import main

sys.exit(main())
