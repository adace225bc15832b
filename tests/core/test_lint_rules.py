"""`nanguard lint` rules: for each rule a realistic positive and negative snippet, in PyTorch and in
TensorFlow/Keras spellings. The checks read the code only (no torch or TensorFlow is imported)."""
from __future__ import annotations

import textwrap

import pytest

from nanguard.core.diagnosis.categories import CATEGORIES
from nanguard.lint.engine import lint_source
from nanguard.lint.registry import rules

TORCH = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
TF = "import tensorflow as tf\nimport keras\nfrom keras import ops\n"


def codes(src: str, header: str = TORCH) -> list:
    return [f.rule for f in lint_source(header + textwrap.dedent(src), "snippet.py")]


# (rule, positive snippet, negative snippet (the same code guarded), header)
CASES = [
    # NGL001 log of a softmax / sigmoid output
    ("NGL001", """
        def nll(logits, y):
            probs = F.softmax(logits, dim=-1)
            return -torch.log(probs.gather(1, y[:, None])).mean()
     """, """
        def nll(logits, y):
            probs = F.softmax(logits, dim=-1)
            return -torch.log(probs.gather(1, y[:, None]) + 1e-8).mean()
     """, TORCH),
    ("NGL001", """
        def bce(x, y):
            p = torch.sigmoid(x)
            return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
     """, """
        def bce(x, y):
            p = torch.sigmoid(x).clamp(1e-6, 1 - 1e-6)
            return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
     """, TORCH),
    ("NGL001", """
        def loss(logits, y):
            pred = tf.nn.softmax(logits)
            return tf.reduce_mean(-tf.reduce_sum(y * tf.math.log(pred), axis=1))
     """, """
        def loss(logits, y):
            pred = tf.nn.softmax(logits)
            return tf.reduce_mean(-tf.reduce_sum(y * tf.math.log(tf.clip_by_value(pred, 1e-10, 1.0)), axis=1))
     """, TF),
    ("NGL001", """
        def loss(logits, y):
            return -ops.sum(y * ops.log(ops.softmax(logits)), axis=-1)
     """, """
        def loss(logits, y):
            return -ops.sum(y * ops.log_softmax(logits), axis=-1)
     """, TF),
    ("NGL001", """
        def focal(pred, gt):
            pos = torch.log(pred) * torch.pow(1 - pred, 2) * gt
            neg = torch.log(1 - pred) * torch.pow(pred, 2) * (1 - gt)
            return -(pos + neg).mean()
     """, """
        def focal(pred, gt):
            pred = pred.clamp(1e-4, 1 - 1e-4)
            pos = torch.log(pred) * torch.pow(1 - pred, 2) * gt
            neg = torch.log(1 - pred) * torch.pow(pred, 2) * (1 - gt)
            return -(pos + neg).mean()
     """, TORCH),
    ("NGL001", """
        def cce(y_true, y_pred):
            return -tf.reduce_sum(y_true * tf.math.log(y_pred), axis=-1)
     """, """
        def cce(y_true, y_pred):
            return -tf.reduce_sum(y_true * tf.math.log(y_pred + 1e-7), axis=-1)
     """, TF),
    # NGL015 log of an input as it came in
    ("NGL015", """
        def nll(y_pred, y_true):
            return F.nll_loss(torch.log(y_pred), y_true)
     """, """
        def nll(y_pred, y_true, eps: float = 1e-8):
            return F.nll_loss(torch.log(y_pred.clamp(min=eps)), y_true)
     """, TORCH),
    ("NGL015", """
        def log_ratio(p, q):
            return tf.math.log(p) - tf.math.log(q)
     """, """
        def log_scale(max_period=10000):
            return tf.math.log(max_period)
     """, TF),
    # NGL016 log of a sum of densities (a mixture density network's likelihood)
    ("NGL016", """
        def mdn_nll(pi, sigma, mu, y):
            dens = torch.exp(-0.5 * ((y - mu) / sigma) ** 2) / sigma
            return -torch.log(torch.sum(pi * torch.prod(dens, 2), dim=1)).mean()
     """, """
        def mdn_nll(log_pi, sigma, mu, y):
            log_dens = -0.5 * ((y - mu) / sigma) ** 2 - torch.log(sigma)
            return -torch.logsumexp(log_pi + log_dens.sum(2), dim=1).mean()
     """, TORCH),
    ("NGL016", """
        def kernel_density(x, centers, h):
            k = tf.exp(-tf.square(x - centers) / (2 * h * h))
            return -tf.math.log(tf.reduce_mean(k, axis=1))
     """, """
        def kernel_density(x, centers, h):
            k = tf.exp(-tf.square(x - centers) / (2 * h * h))
            return -tf.math.log(tf.reduce_mean(k, axis=1) + 1e-12)
     """, TF),
    # NGL002 BCELoss on a sigmoid
    ("NGL002", """
        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 1)
                self.crit = nn.BCELoss()
            def loss(self, x, y):
                return self.crit(torch.sigmoid(self.fc(x)), y)
     """, """
        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 1)
                self.crit = nn.BCEWithLogitsLoss()
            def loss(self, x, y):
                return self.crit(self.fc(x), y)
     """, TORCH),
    ("NGL002", """
        def loss(z, y):
            return F.binary_cross_entropy(z.sigmoid(), y)
     """, """
        def loss(p, y):
            return F.binary_cross_entropy(p, y)
     """, TORCH),
    # NGL003 log of a ReLU output or a count
    ("NGL003", """
        def scale(x):
            return torch.log(F.relu(x))
     """, """
        def scale(x):
            return torch.log(F.relu(x) + 1e-6)
     """, TORCH),
    ("NGL003", """
        def idf(doc_mask):
            df = tf.reduce_sum(tf.cast(doc_mask > 0, tf.float32), axis=0)
            return tf.math.log(df)
     """, """
        def idf(doc_mask):
            df = tf.reduce_sum(tf.cast(doc_mask > 0, tf.float32), axis=0)
            return tf.math.log(df + 1.0)
     """, TF),
    # NGL004 hand-written softmax / logsumexp without the max
    ("NGL004", """
        def my_softmax(z):
            e = torch.exp(z)
            return e / e.sum(dim=-1, keepdim=True)
     """, """
        def my_softmax(z):
            e = torch.exp(z - z.amax(dim=-1, keepdim=True))
            return e / e.sum(dim=-1, keepdim=True)
     """, TORCH),
    ("NGL004", """
        def lse(z):
            return tf.math.log(tf.reduce_sum(tf.exp(z), axis=-1))
     """, """
        def lse(z):
            m = tf.reduce_max(z, axis=-1, keepdims=True)
            return tf.math.log(tf.reduce_sum(tf.exp(z - m), axis=-1))
     """, TF),
    ("NGL004", """
        def partial_likelihood(risk, event):
            log_risk_set = torch.log(torch.cumsum(torch.exp(risk), dim=0))
            return -((risk - log_risk_set) * event).sum()
     """, """
        def partial_likelihood(risk, event):
            log_risk_set = torch.logcumsumexp(risk, dim=0)
            return -((risk - log_risk_set) * event).sum()
     """, TORCH),
    # NGL005 division by a count / a mask's sum
    ("NGL005", """
        def mean_pool(h, attention_mask):
            m = attention_mask.unsqueeze(-1).float()
            return (h * m).sum(1) / m.sum(1)
     """, """
        def mean_pool(h, attention_mask):
            m = attention_mask.unsqueeze(-1).float()
            return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
     """, TORCH),
    ("NGL005", """
        def masked_loss(per_token, labels):
            valid = tf.cast(labels != 0, tf.float32)
            return tf.reduce_sum(per_token * valid) / tf.reduce_sum(valid)
     """, """
        def masked_loss(per_token, labels):
            valid = tf.cast(labels != 0, tf.float32)
            return tf.math.divide_no_nan(tf.reduce_sum(per_token * valid), tf.reduce_sum(valid))
     """, TF),
    ("NGL005", """
        def positive_mean(scores, labels):
            pos = scores[labels == 1]
            return pos.sum() / len(pos)
     """, """
        def positive_mean(scores, labels):
            pos = scores[labels == 1]
            return pos.sum() / max(len(pos), 1)
     """, TORCH),
    ("NGL005", """
        def dice(y_true, y_pred):
            inter = tf.reduce_sum(y_true * y_pred)
            return 2.0 * inter / (tf.reduce_sum(y_true) + tf.reduce_sum(y_pred))
     """, """
        def dice(y_true, y_pred, smooth=1.0):
            inter = tf.reduce_sum(y_true * y_pred)
            return (2.0 * inter + smooth) / (tf.reduce_sum(y_true) + tf.reduce_sum(y_pred) + smooth)
     """, TF),
    ("NGL005", """
        def edge_loss(logits, target, edges):
            per_pixel = F.cross_entropy(logits, target, reduction="none")
            return per_pixel[edges > 0].mean()
     """, """
        def edge_loss(logits, target, edges):
            per_pixel = F.cross_entropy(logits, target, reduction="none")
            return per_pixel[edges > 0].mean() if (edges > 0).any() else per_pixel.sum() * 0
     """, TORCH),
    # NGL006 division by a standard deviation
    ("NGL006", """
        def normalize(adv):
            return (adv - adv.mean()) / adv.std()
     """, """
        def normalize(adv):
            return (adv - adv.mean()) / (adv.std() + 1e-8)
     """, TORCH),
    ("NGL006", """
        def standardize(x):
            return (x - tf.reduce_mean(x, 0)) / tf.math.reduce_std(x, 0)
     """, """
        def standardize(x):
            return (x - tf.reduce_mean(x, 0)) / (tf.math.reduce_std(x, 0) + 1e-5)
     """, TF),
    ("NGL006", """
        class LN(nn.Module):
            def __init__(self):
                super().__init__()
                self.eps = 0
            def forward(self, x):
                return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + self.eps)
     """, """
        class LN(nn.Module):
            def __init__(self):
                super().__init__()
                self.eps = 1e-5
            def forward(self, x):
                return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + self.eps)
     """, TORCH),
    # NGL007 division by a norm
    ("NGL007", """
        def direction(a, b):
            d = a - b
            return d / d.norm(dim=-1, keepdim=True)
     """, """
        def direction(a, b):
            d = a - b
            return d / d.norm(dim=-1, keepdim=True).clamp(min=1e-12)
     """, TORCH),
    ("NGL007", """
        def direction(a, b):
            d = a - b
            return d / tf.norm(d, axis=-1, keepdims=True)
     """, """
        def direction(a, b):
            return tf.math.l2_normalize(a - b, axis=-1)
     """, TF),
    # NGL008 sqrt at 0 / below 0
    ("NGL008", """
        def dist(a, b):
            return torch.sqrt(((a - b) ** 2).sum(-1))
     """, """
        def dist(a, b):
            return torch.sqrt(((a - b) ** 2).sum(-1) + 1e-12)
     """, TORCH),
    ("NGL008", """
        def rmse(pred, y):
            return tf.sqrt(tf.reduce_mean(tf.square(pred - y)))
     """, """
        def rmse(pred, y):
            return tf.sqrt(tf.reduce_mean(tf.square(pred - y)) + 1e-12)
     """, TF),
    ("NGL008", """
        def std(x):
            return (x.pow(2).mean(0) - x.mean(0) ** 2).sqrt()
     """, """
        def std(x):
            return (x.pow(2).mean(0) - x.mean(0) ** 2).clamp(min=0).add(1e-12).sqrt()
     """, TORCH),
    ("NGL008", """
        class MinibatchStd(layers.Layer):
            def call(self, x):
                s = tf.reduce_mean(tf.math.reduce_std(x, axis=0))
                return tf.concat([x, tf.ones_like(x[..., :1]) * s], axis=-1)
     """, """
        class MinibatchStd(layers.Layer):
            def call(self, x):
                s = tf.reduce_mean(tf.sqrt(tf.math.reduce_variance(x, axis=0) + 1e-8))
                return tf.concat([x, tf.ones_like(x[..., :1]) * s], axis=-1)
     """, TF),
    ("NGL008", """
        class Head(nn.Module):
            def forward(self, z):
                return z.std(0).mean()
     """, """
        x = torch.randn(64, 8)
        x = (x - x.mean(0)) / x.std(0).clamp(min=1e-6)
     """, TORCH),
    # NGL009 acos of a cosine
    ("NGL009", """
        def angle(a, b):
            return torch.acos(F.cosine_similarity(a, b, dim=-1))
     """, """
        def angle(a, b):
            return torch.acos(F.cosine_similarity(a, b, dim=-1).clamp(-1 + 1e-6, 1 - 1e-6))
     """, TORCH),
    ("NGL009", """
        def angle(a, b):
            cos = tf.reduce_sum(tf.math.l2_normalize(a, -1) * tf.math.l2_normalize(b, -1), -1)
            return tf.math.acos(cos)
     """, """
        def angle(a, b):
            cos = tf.reduce_sum(tf.math.l2_normalize(a, -1) * tf.math.l2_normalize(b, -1), -1)
            return tf.math.acos(tf.clip_by_value(cos, -1 + 1e-6, 1 - 1e-6))
     """, TF),
    # NGL010 the where gradient trap
    ("NGL010", """
        def safe_log(x):
            return torch.where(x > 0, torch.log(x), torch.zeros_like(x))
     """, """
        def safe_log(x):
            return torch.where(x > 0, torch.log(torch.where(x > 0, x, 1.0)), torch.zeros_like(x))
     """, TORCH),
    ("NGL010", """
        def root(y):
            return tf.where(y > 0, tf.sqrt(y), y)
     """, """
        def root(y):
            return tf.where(y > 0, tf.sqrt(tf.where(y > 0, y, 1.0)), y)
     """, TF),
    # NGL011 a softmax over -inf filled scores
    ("NGL011", """
        def attend(q, k, pad_mask):
            s = q @ k.transpose(-2, -1)
            s = s.masked_fill(pad_mask[:, None, :], float("-inf"))
            return F.softmax(s, dim=-1)
     """, """
        def attend(q, k, pad_mask):
            s = q @ k.transpose(-2, -1)
            s = s.masked_fill(pad_mask[:, None, :], torch.finfo(s.dtype).min)
            return F.softmax(s, dim=-1)
     """, TORCH),
    ("NGL011", """
        def attend(scores, mask):
            scores = tf.where(mask, scores, float("-inf"))
            return tf.nn.softmax(scores, axis=-1)
     """, """
        def attend(scores, mask):
            scores = tf.where(mask, scores, -1e9)
            return tf.nn.softmax(scores, axis=-1)
     """, TF),
    ("NGL011", """
        def attend(dots, mask):
            dots.masked_fill_(mask, -float("-inf"))
            return dots.softmax(dim=-1)
     """, """
        def attend(dots, mask):
            dots.masked_fill_(mask, -torch.finfo(dots.dtype).max)
            return dots.softmax(dim=-1)
     """, TORCH),
    # NGL012 kl_div arguments
    ("NGL012", """
        def distill(s, t):
            return F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), reduction="batchmean")
     """, """
        def distill(s, t):
            return F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), reduction="batchmean", log_target=True)
     """, TORCH),
    ("NGL012", """
        def distill(s, t):
            return nn.KLDivLoss(reduction="batchmean")(F.softmax(s, -1), F.softmax(t, -1))
     """, """
        def distill(s, t):
            return nn.KLDivLoss(reduction="batchmean")(F.log_softmax(s, -1), F.softmax(t, -1))
     """, TORCH),
    # NGL013 an optimizer eps that is 0 in float16 parameters
    ("NGL013", """
        def setup(model):
            model.half()
            return torch.optim.Adam(model.parameters(), lr=1e-3)
     """, """
        def setup(model):
            model.half()
            return torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
     """, TORCH),
    ("NGL013", """
        keras.mixed_precision.set_global_policy("float16")
        opt = keras.optimizers.Adam(learning_rate=1e-3, epsilon=1e-8)
     """, """
        keras.mixed_precision.set_global_policy("float16")
        opt = keras.optimizers.Adam(learning_rate=1e-3, epsilon=1e-4)
     """, TF),
    # NGL014 a tiny eps in float16 math
    ("NGL014", """
        def scores(model, x):
            model = model.to(torch.float16)
            p = model(x)
            return torch.log(p + 1e-8)
     """, """
        def scores(model, x):
            model = model.to(torch.float16)
            p = model(x)
            return torch.log(p + 1e-4)
     """, TORCH),
    ("NGL014", """
        keras.mixed_precision.set_global_policy("mixed_float16")
        def loss(y, p):
            return -tf.reduce_mean(y * tf.math.log(p + 1e-8))
     """, """
        keras.mixed_precision.set_global_policy("mixed_float16")
        def loss(y, p):
            return -tf.reduce_mean(y * tf.math.log(tf.cast(p, tf.float32) + 1e-4))
     """, TF),
    # NGL007: a projection divided by a squared norm
    ("NGL007", """
        def project(g_i, g_j):
            return g_i - (g_i * g_j).sum() / (g_j * g_j).sum() * g_j
     """, """
        def project(g_i, g_j):
            return g_i - (g_i * g_j).sum() / ((g_j * g_j).sum() + 1e-12) * g_j
     """, TORCH),
    # NGL005: ReLU outputs normalised by their own sum
    ("NGL005", """
        def convex(w):
            w = ops.relu(w)
            return w / ops.sum(w, axis=0, keepdims=True)
     """, """
        def convex(w):
            w = ops.relu(w) + 1e-6
            return w / ops.sum(w, axis=0, keepdims=True)
     """, TF),
    # NGL020 log of a determinant; logdet of a trainable matrix
    ("NGL020", """
        def nll(K, y):
            return y @ torch.linalg.solve(K, y) + torch.log(torch.det(K))
     """, """
        def nll(K, y):
            return y @ torch.linalg.solve(K, y) + torch.logdet(K)
     """, TORCH),
    ("NGL020", """
        class InvConv(nn.Module):
            def forward(self, x):
                return x @ self.weight.T, torch.logdet(self.weight)
     """, """
        class InvConv(nn.Module):
            def forward(self, x):
                return x @ self.weight.T, torch.linalg.slogdet(self.weight).logabsdet
     """, TORCH),
    ("NGL020", """
        def nll(K):
            return 0.5 * tf.math.log(tf.linalg.det(K))
     """, """
        def nll(K):
            return 0.5 * tf.linalg.logdet(K)
     """, TF),
    # NGL019 min-max scaling by max - min
    ("NGL019", """
        def scale(w):
            lo = w.amin(dim=1, keepdim=True)
            hi = w.amax(dim=1, keepdim=True)
            return (w - lo) / (hi - lo)
     """, """
        def scale(w):
            lo = w.amin(dim=1, keepdim=True)
            hi = w.amax(dim=1, keepdim=True)
            return (w - lo) / (hi - lo + 1e-8)
     """, TORCH),
    ("NGL019", """
        def scale(w):
            lo = tf.reduce_min(w, axis=1, keepdims=True)
            hi = tf.reduce_max(w, axis=1, keepdims=True)
            return (w - lo) / (hi - lo)
     """, """
        def scale(w):
            lo = tf.reduce_min(w, axis=1, keepdims=True)
            hi = tf.reduce_max(w, axis=1, keepdims=True)
            return (w - lo) / tf.maximum(hi - lo, 1e-8)
     """, TF),
    # NGL005: a mean loss over a boolean-mask selection (a bool mask tensor)
    ("NGL005", """
        train_mask = torch.zeros(100, dtype=torch.bool)
        def step(model, x, y, idx):
            m = train_mask[idx]
            return F.cross_entropy(model(x[idx])[m], y[idx][m])
     """, """
        train_mask = torch.zeros(100, dtype=torch.bool)
        def step(model, x, y, idx):
            m = train_mask[idx]
            return F.cross_entropy(model(x[idx])[m], y[idx][m], reduction="sum") / m.sum().clamp(min=1)
     """, TORCH),
    # NGL013: Keras Ftrl whose accumulator starts at 0 with beta 0
    ("NGL013", """
        opt = keras.optimizers.Ftrl(learning_rate=0.1, initial_accumulator_value=0.0)
     """, """
        opt = keras.optimizers.Ftrl(learning_rate=0.1, initial_accumulator_value=0.0, beta=1.0)
     """, TF),
    # NGL017 zero_grad named, not called
    ("NGL017", """
        def train(model, opt, loader):
            for x, y in loader:
                opt.zero_grad
                loss = F.mse_loss(model(x), y)
                loss.backward()
                opt.step()
     """, """
        def train(model, opt, loader):
            for x, y in loader:
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                opt.step()
     """, TORCH),
    # NGL018 a clip before the backward it should follow
    ("NGL018", """
        def train(model, opt, loader):
            for x, y in loader:
                opt.zero_grad()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                F.mse_loss(model(x), y).backward()
                opt.step()
     """, """
        def train(model, opt, loader):
            for x, y in loader:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the last step's gradients
                opt.step()
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
     """, TORCH),
]


@pytest.mark.parametrize("code,pos,neg,header", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule_positive_and_negative(code, pos, neg, header):
    assert code in codes(pos, header), codes(pos, header)
    assert code not in codes(neg, header), codes(neg, header)


def test_every_rule_has_both_frameworks_or_is_pytorch_only():
    covered = {}
    for code, _, _, header in CASES:
        covered.setdefault(code, set()).add("tf" if header is TF else "torch")
    for r in rules():
        assert r.code in covered, f"{r.code} has no test case"
        # Keras' BCE clips its probabilities; its KLDivergence takes probs; Keras has no zero_grad and clips
        # gradients it already has
        torch_only = {"NGL002", "NGL012", "NGL017", "NGL018"}
        want = {"torch"} if r.code in torch_only else {"torch", "tf"}
        assert covered[r.code] >= want, (r.code, covered[r.code])


def test_rules_have_stable_codes_known_categories_and_runtime_fixes():
    rs = rules()
    assert [r.code for r in rs] == [f"NGL{i:03d}" for i in range(1, len(rs) + 1)]
    for r in rs:
        assert r.category in CATEGORIES
    f = lint_source(TORCH + "def f(x):\n    return torch.log(F.softmax(x, -1))\n", "m.py")[0]
    # the run-time diagnosis' own fix text (rules/log.py), located at the finding
    assert any("torch.log_softmax" in fx and "m.py:5" in fx for fx in f.fixes), f.fixes
    tf = lint_source(TF + "def f(x):\n    return tf.math.log(tf.nn.softmax(x))\n", "m.py")[0]
    assert any("tf.nn.log_softmax" in fx for fx in tf.fixes), tf.fixes  # spoken in the file's framework


def test_numpy_and_math_are_not_framework_ops():
    src = """
        import math
        import numpy as np
        def f(p, n):
            return np.log(np.exp(p) / np.exp(p).sum()), math.log(n), math.sqrt(n)
    """
    assert codes(src, "") == []


def test_causal_mask_from_a_registered_tril_buffer_is_not_flagged():
    src = """
        class Attn(nn.Module):
            def __init__(self, n):
                super().__init__()
                self.register_buffer("bias", torch.tril(torch.ones(n, n)).view(1, 1, n, n))
            def forward(self, att, T):
                att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
                return F.softmax(att, dim=-1)

        class LayerNorm(nn.Module):
            def __init__(self, n):
                super().__init__()
                self.bias = nn.Parameter(torch.zeros(n))
    """
    assert codes(src) == []


def test_no_grad_code_has_no_gradient_findings():
    src = """
        @torch.no_grad()
        def dist(a, b):
            return torch.sqrt(((a - b) ** 2).sum(-1))

        def dist2(a, b):
            with torch.no_grad():
                return torch.sqrt(((a - b) ** 2).sum(-1))
    """
    assert codes(src) == []


def test_a_parameter_shadows_a_module_level_name():
    src = """
        probs = F.softmax(torch.zeros(3), -1)
        def f(probs):
            return torch.log(probs)
        def g():
            return torch.log(probs)
    """
    found = [(f.line, f.rule) for f in lint_source(TORCH + textwrap.dedent(src), "m.py")]
    assert found == [(7, "NGL015"), (9, "NGL001")]  # the parameter is an input, not the module's softmax


def test_a_distribution_normalised_by_its_own_sum_is_not_a_count():
    src = """
        def mix(choice_weights, w):
            uniform = (choice_weights > 0).to(w.dtype)
            uniform /= uniform.sum()
            return uniform
    """
    assert codes(src) == []


def test_a_tested_count_is_not_flagged():
    src = """
        def share(rows):
            b = [r for r in rows if r > 0]
            k = sum(1 for r in b if r > 1)
            return round(k / len(b), 3) if b else None

        def share2(rows):
            b = [r for r in rows if r > 0]
            if not b:
                return None
            return 1 / len(b)

        def share3(rows):
            b = [r for r in rows if r > 0]
            return 1 / len(b)
    """
    assert [(f.rule, f.line) for f in lint_source(TORCH + textwrap.dedent(src), "m.py")] == [("NGL005", 18)]


def test_docs_lint_md_is_current():
    from pathlib import Path
    from nanguard.lint.docs import lint_markdown
    path = Path(__file__).resolve().parents[2] / "docs" / "LINT.md"
    assert path.read_text() == lint_markdown(), "regenerate: python -m nanguard.lint.docs > docs/LINT.md"


def test_values_made_by_this_files_model_and_functions():
    src = """
        class GaussNet(nn.Module):
            def __init__(self):
                super().__init__()
                self.mu, self.sigma = nn.Linear(4, 1), nn.Linear(4, 1)
            def forward(self, v):
                return self.mu(v), torch.relu(self.sigma(v))

        def probs_of(z):
            return torch.softmax(z, -1)

        model = GaussNet()
        clf = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=-1))

        def train(x, y):
            mu, sigma = model(x)
            nll = torch.log(sigma) + 0.5 * ((y - mu) / sigma) ** 2
            a = torch.log(probs_of(x))
            b = torch.log(clf(x))
            c = torch.log(model(x)[0])
            return nll, a, b, c
    """
    found = [(f.line, f.rule) for f in lint_source(TORCH + textwrap.dedent(src), "m.py")]
    assert found == [(20, "NGL003"), (20, "NGL005"), (21, "NGL001"), (22, "NGL001")], found  # sigma is a ReLU: log and / at 0
