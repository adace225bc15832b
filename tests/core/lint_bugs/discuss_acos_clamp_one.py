# source: https://discuss.pytorch.org/t/numerically-stable-acos-dot-product-derivative/12851 (acos of a dot product
# clamped to exactly [-1, 1]: the gradient at +-1 is infinite, NaN in training)
# expect: NGL009 trig_domain
def angle_between(unit_vector0, unit_vector1):
    return unit_vector0.dot(unit_vector1).clamp(-1.0, 1.0).acos()
