# KNOWN MISS (not run by test_lint_bugs.py): the -inf comes from the logits, which the function does not see made.
# source: https://github.com/huggingface/trl/issues/7221 (entropy_from_logits is NaN for a zero-probability token:
# exp(logps) * logps = 0 * -inf)
# expect: NGL011 masked_softmax
import torch
import torch.nn.functional as F


def entropy_from_logits(logits, chunk_size=128):
    entropies = []
    for chunk in logits.reshape(-1, logits.shape[-1]).split(chunk_size, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        entropies.append(-(torch.exp(logps) * logps).sum(-1))
    return torch.cat(entropies)
