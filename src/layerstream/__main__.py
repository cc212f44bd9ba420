"""``python -m layerstream`` (and ``accelerate launch -m layerstream run ...``)."""

import sys

from .cli import main

sys.exit(main())
