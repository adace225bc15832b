# source: https://github.com/afiaka87/glide-finetune/issues/5 (model in half precision, Adam's default eps=1e-8 is 0 in
# float16: NaN after the first step; fixed with eps=1e-4 in PR #6)
# expect: NGL013 optimizer_numerics
import torch


def make_optimizer(model, lr):
    model = model.half()
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
