# source: https://github.com/pytorch/pytorch/issues/49844 (sigmoid + BCELoss saturates: the loss is clamped at 100
# and the gradient is lost; BCEWithLogitsLoss on the logits keeps it)
# expect: NGL002 log_domain
import torch
import torch.nn as nn


class Scorer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, 1)
        self.criterion = nn.BCELoss()

    def loss(self, x, y):
        return self.criterion(torch.sigmoid(self.fc(x)), y)
