# Linear regression on unscaled features with plain SGD above the stability limit: the loss grows
# geometrically and overflows.
import sys

from _common import train
from setups import regression_setup

train(*regression_setup()[:4], 200, recover="auto" if "--recover" in sys.argv else None)
