# A float16 model whose middle block sums squares: past 65504 it is inf in float16, float32 holds it.
from _common import train
from setups import fp16_setup

train(*fp16_setup()[:4], 5)
