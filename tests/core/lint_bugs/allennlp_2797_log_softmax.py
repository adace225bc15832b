# source: https://github.com/allenai/allennlp/issues/2797 (softmax gives exactly 0, -log(prob) is inf, loss NaN)
# expect: NGL001 log_domain
import torch


def label_loss(label_logits, labels):
    label_probs = torch.nn.functional.softmax(label_logits, dim=-1)
    log_label_probs = -torch.log(label_probs)
    loss = log_label_probs * labels.float()
    return torch.sum(loss)
