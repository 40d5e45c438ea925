"""``python -m pyllamacpp``: the ``pyllamacpp`` command."""

import sys

from .cli import main

sys.exit(main())
