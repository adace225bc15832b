# source: https://github.com/HabanaAI/vllm-fork/pull/318 (a padding sample with seq_len 0 gave an empty attention mask:
# 0 divided by 0)
# expect: NGL005 div_by_zero
def mean_pool(hidden, attention_mask):
    mask = attention_mask.unsqueeze(-1).float()
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1)
