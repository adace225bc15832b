# Entity typing: an entity vector is the mean of its mentions' vectors; a document whose entity slot
# has no mention gives 0/0 in that document's row (per-sample division by zero).
from _common import train
from setups import entity_setup

train(*entity_setup()[:4], 35)
