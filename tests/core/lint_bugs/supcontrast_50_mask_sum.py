# source: https://github.com/HobbitLong/SupContrast/issues/50 (mask.sum(1) has a 0, so the loss is nan)
# expect: NGL005 div_by_zero
import torch


def sup_con(features, labels, temperature=0.07):
    mask = torch.eq(labels[:, None], labels[None, :]).float()
    logits = torch.matmul(features, features.T) / temperature
    logits = logits - logits.max(dim=1, keepdim=True)[0].detach()
    logits_mask = 1 - torch.eye(len(labels))
    mask = mask * logits_mask
    exp_logits = torch.exp(logits) * logits_mask
    log_prob = logits - torch.log(exp_logits.sum(1, keepdim=True))
    mean_log_prob_pos = (mask * log_prob).sum(1) / mask.sum(1)
    return -mean_log_prob_pos.mean()
