# A float16 scorer: softmax -> learned weights -> renormalise -> clamp -> log. As the inputs grow, a
# probability below float16's smallest subnormal (6e-8) rounds to 0 three ops before the log: log(0).
# The op-level rules see a log of 0 whose float32 re-run of the two ops before it is still 0.
from _common import train
from setups import underflow_setup

train(*underflow_setup()[:4], 6)
