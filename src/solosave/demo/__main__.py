"""``python -m solosave.demo`` / ``torchrun ... -m solosave.demo ...``: see :mod:`solosave.demo.launch`."""

import sys

from .launch import main

sys.exit(main())
