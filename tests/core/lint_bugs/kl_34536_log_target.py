# source: https://github.com/pytorch/pytorch/issues/34536 (kl_div with a target in log space needs log_target=True;
# a log-probability target read as probabilities gives target * log(target) = NaN)
# expect: NGL012 kl_misuse
import torch.nn.functional as F


def kl(student_logits, teacher_logits):
    return F.kl_div(F.log_softmax(student_logits, -1), F.log_softmax(teacher_logits, -1), reduction="batchmean")
