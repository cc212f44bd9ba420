"""``python -m layerstream`` (and ``accelerate launch -m layerstream run ...``)."""

import sys

from .commands.cli import main

sys.exit(main())
