"""``python -m captum_transformers``: the offline demo."""
import sys

from .demo import main

sys.exit(main())
