"""``python -m cmbs_async``: the same as the ``cmbs`` command."""

import sys

from .cli.main import main

sys.exit(main())
