"""``python -m captum_transformers``: the ``captum-transformers`` command line (default: ``explain``)."""
import sys

from .cli import main

sys.exit(main())
