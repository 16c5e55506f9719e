"""The suites' shapes: ``pyfused.bench.shapes`` (the tuner uses the same ones), under the name the
suites import (``from . import shapes``)."""
import sys

from pyfused.bench import shapes as _shapes

sys.modules[__name__] = _shapes
