# source: https://github.com/pytorch/pytorch/issues/5282 (KLDivLoss given probabilities as input: the input must be
# log-probabilities)
# expect: NGL012 kl_misuse
import torch.nn as nn
import torch.nn.functional as F


def distill(student_logits, teacher_logits):
    kl = nn.KLDivLoss(reduction="batchmean")
    return kl(F.softmax(student_logits, dim=1), F.softmax(teacher_logits, dim=1))
