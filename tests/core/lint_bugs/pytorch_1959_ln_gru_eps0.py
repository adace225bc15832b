# source: https://github.com/pytorch/pytorch/issues/1959 (a hand-written LayerNorm GRU cell with eps = 0 divides by std)
# expect: NGL006 variance_zero
import torch.nn as nn


class LayerNormGRUCell(nn.GRUCell):
    def __init__(self, input_size, hidden_size, bias=True):
        super(LayerNormGRUCell, self).__init__(input_size, hidden_size, bias)
        self.eps = 0

    def _layer_norm_x(self, x, g, b):
        mean = x.mean(1).expand_as(x)
        std = x.std(1).expand_as(x)
        return g.expand_as(x) * ((x - mean) / (std + self.eps)) + b.expand_as(x)
