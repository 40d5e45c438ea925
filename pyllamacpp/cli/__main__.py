"""``python -m pyllamacpp.cli``: the ``pyllamacpp`` command."""

import sys

from . import main

sys.exit(main())
