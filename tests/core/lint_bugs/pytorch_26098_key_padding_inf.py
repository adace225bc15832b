# source: https://github.com/pytorch/pytorch/issues/26098 (key_padding_mask filled with float('-inf'): a sequence
# that is all padding gives NaN)
# expect: NGL011 masked_softmax
import torch.nn.functional as F


def attend(attn_output_weights, key_padding_mask, bsz, num_heads, tgt_len, src_len):
    attn_output_weights = attn_output_weights.view(bsz, num_heads, tgt_len, src_len)
    attn_output_weights = attn_output_weights.masked_fill(
        key_padding_mask.unsqueeze(1).unsqueeze(2),
        float('-inf'),
    )
    attn_output_weights = attn_output_weights.view(bsz * num_heads, tgt_len, src_len)
    return F.softmax(attn_output_weights, dim=-1)
