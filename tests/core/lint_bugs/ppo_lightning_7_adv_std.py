# source: https://github.com/sidhantls/ppo_lightning/issues/7 (advantage normalization without eps: a batch of equal
# advantages, or of one, has std 0 (or NaN))
# expect: NGL006 variance_zero
def normalize_advantages(adv):
    adv = (adv - adv.mean()) / adv.std()
    return adv
