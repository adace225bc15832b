"""Tests for nanguard.pytorch.locate.OpRecorder: real (tiny) training steps that go non-finite.

Each scenario marks its origin line with a trailing ``# ORIGIN:<name>`` comment; the
expected line number is read from this file so the tests do not depend on line offsets.
"""
from __future__ import annotations

import inspect
import json

import pytest
import torch
import torch.nn.functional as F

from nanguard.core.diagnosis import diagnose
from nanguard.pytorch.locate import OpRecorder

_SRC = inspect.getsource(inspect.getmodule(inspect.currentframe()))


def line_of(tag: str) -> int:
    """1-based line number of the line carrying ``# ORIGIN:<tag>``."""
    for i, text in enumerate(_SRC.splitlines(), start=1):
        if text.rstrip().endswith(f"# ORIGIN:{tag}"):
            return i
    raise AssertionError(f"no ORIGIN:{tag} marker")


def mode_stacks() -> tuple[int, int]:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return len(_get_current_dispatch_mode_stack()), len(_get_current_function_mode_stack())


def armed_step(model: torch.nn.Module, opt: torch.optim.Optimizer, forward, *, roots=None,
               preexisting_arm: bool = False) -> dict:
    """One training step (forward, backward, optimizer) under an OpRecorder, with the stage calls a guard makes."""
    rec = OpRecorder(named_params=dict(model.named_parameters()), named_buffers=dict(model.named_buffers()),
                     roots=[model] if roots is None else roots, optimizers=[opt])
    rec.start()
    try:
        loss = forward()
        rec.mark_loss(loss)
        rec.set_stage("backward")
        opt.zero_grad()
        loss.backward()
        rec.set_stage("optimizer")
        opt.step()
    finally:
        rec.stop()
    res = rec.result()
    json.dumps(res, allow_nan=False)      # strictly JSON-serialisable
    return res


def check(res: dict, *, phase: str, tag: str | None, category: str, history=None) -> dict:
    assert res["reproduced"], res
    assert res["phase"] == phase, (res["phase"], res)
    if tag is not None:
        o = res["origin"]
        assert o["file"] == __file__, o
        assert o["line"] == line_of(tag), (o["line"], line_of(tag), o)
    d = diagnose(res, history or [], phase=phase)
    json.dumps(d, allow_nan=False)
    assert d["category"] == category, (d["category"], d["summary"], res.get("facts"))
    assert 0.0 <= d["confidence"] <= 1.0 and d["fixes"] and d["summary"]
    return d


def calm_history(n: int = 6) -> list[dict]:
    return [{"step": i, "loss": 1.0 - 0.05 * i, "grad_norm": 1.0 + 0.1 * (i % 3), "group_grad_norms": [1.0],
             "param_norm": 5.0, "update_ratio": 0.01, "lr": [0.1], "loss_scale": None, "skipped": False}
            for i in range(n)]


# --------------------------------------------------------------------------- forward origins
def test_log_of_saturated_sigmoid_is_log_domain():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(10.0)
    x = torch.ones(8, 4)
    y = torch.zeros(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def fwd():
        p = torch.sigmoid(model(x))
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # ORIGIN:bce

    res = armed_step(model, opt, fwd)
    o = res["origin"]
    assert o["op"] == "aten.log.default" and o["api"] == "torch.log" and o["stage"] == "forward"
    assert res["facts"]["log_domain"]["zeros"] == 8
    assert res["facts"]["float64_check"]["finite"] is False
    d = check(res, phase="forward", tag="bce", category="log_domain", history=calm_history())
    assert any("binary_cross_entropy_with_logits" in f for f in d["fixes"])
    assert "test_locate.py:%d" % line_of("bce") in d["summary"]


def test_mean_over_empty_group_is_div_by_zero():
    torch.manual_seed(0)
    enc = torch.nn.Linear(3, 5)
    opt = torch.optim.SGD(enc.parameters(), lr=0.1)
    feats = torch.randn(6, 3)
    assign = torch.tensor([[1., 1., 0., 0., 1., 1.], [0., 0., 1., 1., 0., 0.], [0., 0., 0., 0., 0., 0.]])

    def fwd():
        h = enc(feats)
        ent = assign @ h / assign.sum(-1, keepdim=True)  # ORIGIN:div
        return ent.pow(2).mean()

    res = armed_step(enc, opt, fwd)
    zd = res["facts"]["zero_denominator"]
    assert zd["zeros"] == 1 and zd["zero_over_zero"] == 5 and zd["from_reduction"]
    # the bad row is row 2 of the (groups x features) result, not a row of the batch of 6 (issue 17)
    assert res["origin"]["tensor_rows"] == [2] and res["origin"]["samples"] == []
    check(res, phase="forward", tag="div", category="div_by_zero")


def test_a_flat_token_stream_does_not_hide_the_bad_sample():
    """EmbeddingBag takes the tokens of the whole batch as one flat stream (plus offsets): its length is
    not the batch size, so the bad row of the per-document logits must still be named as a sample."""
    torch.manual_seed(0)
    bag, fc = torch.nn.EmbeddingBag(50, 8, mode="sum"), torch.nn.Linear(8, 3)
    model = torch.nn.ModuleDict({"bag": bag, "fc": fc})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 50, (40,))
    offsets = torch.tensor([0, 10, 20, 30])
    shift = torch.tensor([0.0, 0.0, 1e3, 0.0]).unsqueeze(1)  # document 2's logits are huge: exp overflows

    def fwd():
        logits = fc(bag(tokens, offsets)) + shift
        probs = torch.exp(logits) / torch.exp(logits).sum(1, keepdim=True)  # ORIGIN:flat_exp
        return -torch.log(probs[:, 0]).mean()

    res = armed_step(model, opt, fwd, roots=[bag, fc])
    assert res["origin"]["line"] == line_of("flat_exp"), res["origin"]
    assert res["origin"]["samples"] == [2], res["origin"]


class TinyAttention(torch.nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.head = torch.nn.Linear(d, 2)

    def forward(self, x, pad):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)).masked_fill(pad[:, None, :], float("-inf"))
        att = torch.softmax(scores, dim=-1)  # ORIGIN:softmax
        return self.head((att @ v).mean(1))


def _attention_step(pad: torch.Tensor) -> dict:
    torch.manual_seed(0)
    model = TinyAttention()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(pad.shape[0], pad.shape[1], 8)
    y = torch.zeros(pad.shape[0], dtype=torch.long)
    return armed_step(model, opt, lambda: F.cross_entropy(model(x, pad), y))


def test_all_masked_softmax_row_is_masked_softmax_with_module_path():
    pad = torch.zeros(4, 5, dtype=torch.bool)
    pad[2] = True                       # an all-padding sequence
    res = _attention_step(pad)
    assert res["origin"]["module"] == "" and res["origin"]["module_type"] == "TinyAttention"
    sm = res["facts"]["softmax_all_masked_rows"]
    assert sm["count"] == 5 and sm["batch_rows"] == [2]
    check(res, phase="forward", tag="softmax", category="masked_softmax")


def test_partially_masked_attention_is_not_reported():
    pad = torch.zeros(4, 5, dtype=torch.bool)
    pad[:, 3:] = True                   # -inf masks, but every row keeps finite entries
    res = _attention_step(pad)
    assert res["reproduced"] is False and res["origin"] is None and res["phase"] is None


@pytest.mark.filterwarnings("ignore:std")
def test_std_of_single_sample_is_variance_zero():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xb = torch.randn(1, 4)

    def fwd():
        z = (xb - xb.mean(0)) / xb.std(0)  # ORIGIN:std
        return F.cross_entropy(model(z), torch.tensor([1]))

    res = armed_step(model, opt, fwd)
    sv = res["facts"]["std_var"]
    assert sv["n"] == 1 and sv["degenerate"] is True
    check(res, phase="forward", tag="std", category="variance_zero")


def test_kl_div_with_log_target_is_kl_misuse():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, 6)

    def fwd():
        lp, lq = F.log_softmax(model(x), -1), F.log_softmax(model(x), -1)
        return F.kl_div(lp, lq, reduction="batchmean")  # ORIGIN:kl

    res = armed_step(model, opt, fwd)
    assert res["origin"]["api"] == "torch.nn.functional.kl_div"
    kl = res["facts"]["kl_div"]
    assert kl["log_target"] is False and kl["target_looks_like_log_probs"] is True
    d = check(res, phase="forward", tag="kl", category="kl_misuse")
    assert any("log_target=True" in f for f in d["fixes"])


def test_acos_beyond_one_is_trig_domain():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = torch.randn(5, 3)

    def fwd():
        cos = (model(a) * model(a)).sum(-1) / model(a).pow(2).sum(-1) * 1.5
        return torch.acos(cos).mean()  # ORIGIN:acos

    res = armed_step(model, opt, fwd)
    assert res["facts"]["trig_domain"]["abs_gt_1"] == 5
    check(res, phase="forward", tag="acos", category="trig_domain")


def test_acosh_below_one_is_trig_domain_with_its_own_domain():
    # a network that predicts the Lorentz-model time coordinate (which must be >= 1) directly and takes its
    # acosh: acosh is NaN below 1, a different domain from acos/asin (|x| > 1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 4)
    with torch.no_grad():
        below = int((model(x) + 1.0 < 1).sum())
    assert 0 < below < 16

    def fwd():
        t = model(x).squeeze(-1) + 1.0
        return torch.acosh(t).mean()  # ORIGIN:acosh

    res = armed_step(model, opt, fwd)
    assert res["origin"]["op"] == "aten.acosh.default"
    dom = res["facts"]["domain"]
    assert dom["condition"] == "x < 1" and dom["inside"] == below and dom["numel"] == 16
    assert "trig_domain" not in res["facts"]
    d = check(res, phase="forward", tag="acosh", category="trig_domain", history=calm_history())
    assert f"{below} value(s) with x < 1 of 16" in d["summary"], d["summary"]
    assert any("clamp(min=1 + 1e-6)" in f for f in d["fixes"])
    assert not any("1 - 1e-6" in f for f in d["fixes"])    # acos's clamp into (-1, 1) makes every acosh NaN


def test_acosh_gradient_at_one_is_a_backward_trig_domain():
    # Poincare-ball distance acosh(1 + 2|a - b|^2 / ((1 - |a|^2)(1 - |b|^2))): a point paired with itself
    # gives exactly 1, where acosh is 0 but its gradient 1/sqrt(x^2 - 1) is infinite (then inf * 0 = NaN)
    torch.manual_seed(0)
    enc = torch.nn.Linear(5, 2)
    opt = torch.optim.SGD(enc.parameters(), lr=0.1)
    x = torch.randn(6, 5)
    i, j = torch.tensor([0, 1, 2, 3]), torch.tensor([4, 1, 5, 0])   # (1, 1) is a self-pair

    def fwd():
        u = 0.5 * torch.tanh(enc(x))
        a, b = u[i], u[j]
        arg = 1 + 2 * ((a - b) ** 2).sum(-1) / ((1 - (a ** 2).sum(-1)) * (1 - (b ** 2).sum(-1)))
        return torch.acosh(arg).mean()  # ORIGIN:acoshbwd

    res = armed_step(enc, opt, fwd)
    o = res["origin"]
    assert o["stage"] == "backward" and o["autograd_node"] == "AcoshBackward0"
    assert o["forward_op"] == "aten.acosh.default" and res["sink"]["kind"] == "grad"
    dom = res["facts"]["domain"]
    assert dom["inside"] == 0 and dom["grad_inside"] == 1 and dom["min"] == 1.0
    d = check(res, phase="backward", tag="acoshbwd", category="trig_domain")
    assert "AcoshBackward0" in d["summary"] and "1 input(s) with x <= 1 of 4" in d["summary"], d["summary"]


def test_log1p_of_minus_saturated_sigmoid_is_log_domain_at_minus_one():
    torch.manual_seed(0)
    fc = torch.nn.Linear(2, 1)
    with torch.no_grad():
        fc.weight.fill_(20.0)
    opt = torch.optim.SGD(fc.parameters(), lr=0.1)
    x = torch.ones(3, 2)

    def fwd():
        p = torch.sigmoid(fc(x))                       # z ~ 40: rounds to exactly 1.0 in float32
        return -torch.log1p(-p).mean()  # ORIGIN:log1p

    res = armed_step(fc, opt, fwd)
    assert res["origin"]["op"] == "aten.log1p.default"
    ld = res["facts"]["log_domain"]
    assert ld["limit"] == -1.0 and ld["le_limit"] == 3 and ld["min"] == -1.0
    d = check(res, phase="forward", tag="log1p", category="log_domain", history=calm_history())
    assert "values <= -1 in 3 of 3" in d["summary"], d["summary"]
    assert any("F.logsigmoid(-z)" in f for f in d["fixes"]) and any("clamp(min=-1 + 1e-6)" in f for f in d["fixes"])
    assert not any("torch.log(x.clamp(min=1e-12))" in f for f in d["fixes"])   # log's fix, wrong for log1p


def test_every_family_evidence_has_a_torch_gatherer():
    from nanguard.core.diagnosis import families
    from nanguard.pytorch.locate.evidence import GATHERERS
    assert {(f.name, e) for f in families.families() for e in f.evidence if e not in GATHERERS} == set()


def test_negative_base_under_element_wise_fractional_exponents_is_sqrt_domain():
    # x ** b with a learned exponent per element: a negative base under a non-integer exponent is NaN
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    b = torch.nn.Parameter(torch.full((4,), 1.7))
    opt = torch.optim.SGD(list(model.parameters()) + [b], lr=0.1)
    a = torch.randn(6, 3)

    def fwd():
        h = model(a) - 0.1
        return (h ** b).mean()  # ORIGIN:tpow

    res = armed_step(model, opt, fwd)
    sd = res["facts"]["sqrt_domain"]
    assert sd["neg_base_fractional_exp"] > 0 and sd["fractional"] is True
    d = check(res, phase="forward", tag="tpow", category="sqrt_domain", history=calm_history())
    assert "negative base" in d["summary"] and "clamp" in d["fixes"][0]


def test_zero_base_under_element_wise_negative_exponents_is_div_by_zero():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    e = torch.nn.Parameter(torch.full((4,), -2.0))
    opt = torch.optim.SGD(list(model.parameters()) + [e], lr=0.1)
    a = torch.randn(6, 3)

    def fwd():
        h = torch.relu(model(a))
        return (h ** e).mean()  # ORIGIN:zpow

    res = armed_step(model, opt, fwd)
    assert res["facts"]["sqrt_domain"]["zero_base_negative_exp"] > 0
    check(res, phase="forward", tag="zpow", category="div_by_zero", history=calm_history())


def test_label_smoothing_over_minus_inf_masked_logits_is_the_reduction_not_the_mask():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    allowed = torch.tensor([True, True, True, False, False])

    def fwd(smoothing):
        logits = model(x).masked_fill(~allowed, float("-inf"))
        return F.cross_entropy(logits, y, label_smoothing=smoothing)  # ORIGIN:smooth

    assert torch.isfinite(fwd(0.0))  # the mask alone is fine: softmax absorbs it
    res = armed_step(model, opt, lambda: fwd(0.1))
    assert res["facts"]["mask_escape"]["mask_op"] == "masked_fill"
    d = check(res, phase="forward", tag="smooth", category="masked_softmax", history=calm_history())
    assert "label smoothing" in d["summary"]


def test_handwritten_softmax_exp_overflow():
    torch.manual_seed(0)
    fc = torch.nn.Linear(4, 3)
    with torch.no_grad():
        fc.weight.fill_(30.0)
    opt = torch.optim.SGD(fc.parameters(), lr=0.1)
    x = torch.ones(2, 4)

    def fwd():
        z = fc(x)
        probs = torch.exp(z) / torch.exp(z).sum(1, keepdim=True)  # ORIGIN:exp
        return -torch.log(probs[:, 0]).mean()

    res = armed_step(fc, opt, fwd)
    assert res["origin"]["op"] == "aten.exp.default"
    assert res["facts"]["exp_input_max"] > res["facts"]["overflow_threshold"]
    assert res["facts"]["float64_check"]["finite"] is True
    check(res, phase="forward", tag="exp", category="exp_overflow", history=calm_history())


def test_an_overflow_a_division_made_zero_is_the_origin_of_the_log_of_that_zero():
    """InfoNCE by hand: one negative pair's exp overflows (exp(95) = inf) while the positive's does not
    (exp(80)): pos / sum = 0 is finite, and log(0) = -inf. The failure was born at the exp."""
    w = torch.nn.Parameter(torch.eye(2))
    opt = torch.optim.SGD([w], lr=0.1)
    x = torch.tensor([[1.0, 0.0], [0.0, 0.5]])
    y = torch.tensor([[0.8, 0.0], [0.95, 0.0]])
    holder = torch.nn.Module()
    holder.w = w

    def fwd():
        sim = (x @ w) @ y.t()
        allp = torch.exp(sim / 0.01).sum(dim=1)  # ORIGIN:negexp
        pos = torch.exp(sim.diagonal() / 0.01)
        return -torch.log(pos / allp).mean()

    res = armed_step(holder, opt, fwd)
    assert res["origin"]["op"] == "aten.exp.default", res["origin"]
    check(res, phase="forward", tag="negexp", category="exp_overflow", history=calm_history())


def test_float16_linear_overflow_names_module():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).half()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[2].weight.fill_(300.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = (torch.rand(4, 4) * 100 + 50).half()

    def fwd():
        pred = model(x)  # ORIGIN:fp16
        return pred.float().abs().mean()

    res = armed_step(model, opt, fwd)
    o = res["origin"]
    assert o["module"] == "2" and o["dtype"] == "float16" and o["module_type"] == "Linear"
    assert res["facts"]["float32_check"]["direct_finite"] is True
    d = check(res, phase="forward", tag="fp16", category="low_precision_overflow")
    assert "'2'" in d["summary"]


def test_float16_eps_underflow():
    torch.manual_seed(0)
    fc = torch.nn.Linear(4, 3).half()
    with torch.no_grad():
        fc.weight.zero_()
        fc.bias.copy_(torch.tensor([0.0, 25.0, 0.0]))
    opt = torch.optim.SGD(fc.parameters(), lr=0.1)
    x = torch.randn(4, 4).half()
    target = F.one_hot(torch.tensor([0, 1, 2, 1]), 3).half()

    def fwd():
        probs = torch.softmax(fc(x), dim=-1)
        return -(target * torch.log(probs + 1e-8)).sum(-1).mean()  # ORIGIN:eps16

    res = armed_step(fc, opt, fwd)
    eps = res["facts"]["eps_constants"]
    assert eps and eps[0]["rounds_to_zero"] is True and eps[0]["dtype"] == "float16"
    assert res["facts"]["float32_check"]["chain_finite"] is True
    check(res, phase="forward", tag="eps16", category="low_precision_underflow")


def test_float32_log_of_rounded_probability_is_not_low_precision():
    torch.manual_seed(0)
    fc = torch.nn.Linear(2, 1)
    with torch.no_grad():
        fc.weight.fill_(20.0)
    opt = torch.optim.SGD(fc.parameters(), lr=0.1)
    x = torch.ones(3, 2)

    def fwd():
        p = torch.sigmoid(fc(x)).clamp(max=1 - 1e-12)        # 1 - 1e-12 is 1.0 in float32: no effect
        return -torch.log(1 - p).mean()  # ORIGIN:f32eps

    res = armed_step(fc, opt, fwd)
    assert res["origin"]["dtype"] == "float32" and "float32_check" not in res["facts"]
    check(res, phase="forward", tag="f32eps", category="log_domain")


# --------------------------------------------------------------------------- backward origins
def test_sqrt_of_zero_distance_is_a_backward_sqrt_domain():
    torch.manual_seed(0)
    net = torch.nn.Linear(5, 3)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.randn(6, 5)
    i, j = torch.tensor([0, 1, 2, 3]), torch.tensor([4, 1, 5, 0])   # pair (1, 1) is a self-pair

    def fwd():
        za, zb = net(x[i]), net(x[j])
        dist = torch.sqrt(((za - zb) ** 2).sum(-1))  # ORIGIN:sqrt
        return dist.pow(2).mean() + torch.relu(2.0 - dist).mean()

    res = armed_step(net, opt, fwd)
    o = res["origin"]
    assert o["stage"] == "backward" and o["autograd_node"] == "SqrtBackward0"
    assert o["forward_op"] == "aten.sqrt.default" and o["forward_line"] == line_of("sqrt")
    assert res["facts"]["sqrt_domain"]["zeros"] == 1
    assert res["sink"]["kind"] == "grad"
    check(res, phase="backward", tag="sqrt", category="sqrt_domain")


def test_vector_norm_at_zero_is_clean():
    torch.manual_seed(0)
    net = torch.nn.Linear(5, 3)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.randn(4, 5)

    def fwd():
        za, zb = net(x), net(x[[0, 1, 3, 3]])
        return torch.linalg.vector_norm(za - zb, dim=1).mean() + (za - zb).norm(dim=1).mean()

    res = armed_step(net, opt, fwd)
    assert res["reproduced"] is False and res["origin"] is None
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())


class Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

    def forward(self, s, legal, safe: bool):
        probs = torch.softmax(self.body(s), -1) * legal
        probs = probs / probs.sum(-1, keepdim=True)
        if safe:
            pos = probs > 0
            return torch.where(pos, torch.log(torch.where(pos, probs, torch.ones_like(probs))), 0.0)
        return torch.where(probs > 0, torch.log(probs), torch.zeros_like(probs))  # ORIGIN:wherelog


def _policy_step(safe: bool) -> dict:
    torch.manual_seed(0)
    pol = Policy()
    opt = torch.optim.Adam(pol.parameters(), lr=1e-3)
    s = torch.randn(5, 4)
    legal = torch.ones(5, 3)
    legal[1, 2] = 0.0

    def fwd():
        logp = pol(s, legal, safe)
        return -(logp[:, 0].mean()) + 0.01 * (logp.exp() * logp).sum(-1).mean()

    return armed_step(pol, opt, fwd)


def test_where_hides_log_zero_but_not_its_gradient():
    res = _policy_step(safe=False)
    o = res["origin"]
    assert o["autograd_node"] == "LogBackward0" and o["forward_op"] == "aten.log.default"
    assert o["module"] == "" and res["facts"]["where_trap"] is True
    check(res, phase="backward", tag="wherelog", category="where_gradient_trap")


def test_double_where_safe_log_is_clean():
    res = _policy_step(safe=True)
    assert res["reproduced"] is False


def test_where_over_exp_overflow_traps_gradient_from_forward_op():
    torch.manual_seed(0)
    fc = torch.nn.Linear(2, 2)
    with torch.no_grad():
        fc.weight.fill_(60.0)
    opt = torch.optim.SGD(fc.parameters(), lr=0.1)
    x = torch.ones(3, 2)

    def fwd():
        z = fc(x)
        return torch.where(z < 50, torch.exp(z), z).mean()  # ORIGIN:whereexp

    res = armed_step(fc, opt, fwd)
    assert res["phase"] == "backward" and res["origin"]["stage"] == "forward"
    assert res["facts"]["where_trap"] is True
    check(res, phase="backward", tag="whereexp", category="where_gradient_trap")


# --------------------------------------------------------------------------- pre-existing values
def test_nan_sample_in_dataset_is_bad_input_data_with_source_row():
    torch.manual_seed(0)
    data = torch.randn(20, 3)
    data[7, 1] = float("nan")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.tensor([3, 9, 7, 0])

    res = armed_step(model, opt, lambda: model(data[idx]).pow(2).mean())
    pre = res["preexisting"]
    assert res["phase"] == "data" and res["origin"] is None
    assert pre["kind"] == "data" and pre["samples"] == [2] and pre["source_rows"] == [7]
    assert pre["rows_in_tensor"] == [7]
    d = diagnose(res, [], phase="forward")
    assert d["category"] == "bad_input_data" and "[7]" in d["summary"]


def test_nan_parameter_before_step_is_param_corruption():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with torch.no_grad():
        model[2].weight[1, 0] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 3)
    res = armed_step(model, opt, lambda: F.cross_entropy(model(x), torch.zeros(5, dtype=torch.long)))
    assert res["phase"] == "params" and res["preexisting"]["kind"] == "param"
    assert res["preexisting"]["name"] == "2.weight"
    d = diagnose(res, [], phase="params")
    assert d["category"] == "param_corruption" and "2.weight" in d["summary"]


def test_parameter_written_non_finite_while_armed_is_param_corruption():
    """Armed before the model is set up (first_bad_step == 0): names are learnt from the modules."""
    torch.manual_seed(0)
    given: dict = {}
    rec = OpRecorder(named_params=given, named_buffers={})
    rec.start()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        feats = model[0](torch.randn(4, 3))
        labels = torch.tensor([0, 0, 0, 0])
        with torch.no_grad():
            for c in range(2):
                model[1].weight[c] = feats[labels == c].mean(0)  # ORIGIN:imprint
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = F.cross_entropy(model(torch.randn(4, 3)), labels)
        rec.mark_loss(loss)
        rec.set_stage("backward")
        loss.backward()
        rec.set_stage("optimizer")
        opt.step()
    finally:
        rec.stop()
    given["net:1.weight"] = model[1].weight     # the caller learns the names late; its names win
    res = rec.result()
    assert res["phase"] == "params"
    pre = res["preexisting"]
    assert pre["kind"] == "param" and pre["name"] == "net:1.weight" and pre["rows_in_tensor"] == [1]
    assert pre["written_by"]["line"] == line_of("imprint")
    d = diagnose(res, [], phase="params")
    assert d["category"] == "param_corruption"


# --------------------------------------------------------------------------- optimizer origins
@pytest.mark.parametrize("foreach", [False, True])
def test_adam_zero_eps_zero_grad_is_optimizer_numerics(foreach):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    unused = torch.nn.Parameter(torch.ones(2))      # gets an all-zero gradient
    opt = torch.optim.Adam(list(model.parameters()) + [unused], lr=1e-3, eps=0.0, foreach=foreach)
    x = torch.randn(4, 3)
    named = dict(model.named_parameters())
    named["scale"] = unused
    rec = OpRecorder(named_params=named, named_buffers={}, roots=[model], optimizers=[opt])
    with rec:
        loss = model(x).pow(2).mean() + 0.0 * unused.sum()
        rec.mark_loss(loss)
        rec.set_stage("backward")
        loss.backward()
        rec.set_stage("optimizer")
        opt.step()
    res = rec.result()
    json.dumps(res, allow_nan=False)
    assert res["reproduced"] and res["phase"] == "optimizer" and res["origin"]["stage"] == "optimizer"
    assert res["optimizer"]["param"] == "scale" and res["optimizer"]["state"] == "exp_avg_sq"
    d = diagnose(res, [], phase="optimizer")
    assert d["category"] == "optimizer_numerics" and "scale" in d["summary"]


# --------------------------------------------------------------------------- robustness
def test_odd_tensors_inplace_views_and_non_tensor_outputs_do_not_break_recording():
    before = mode_stacks()
    n_hooks = len(torch.nn.modules.module._global_forward_hooks)
    rec = OpRecorder(named_params={}, named_buffers={})
    with rec:
        a = torch.arange(6).reshape(2, 3)                    # integer
        b = a > 2                                           # bool
        c = torch.randn(3, dtype=torch.complex64) * 2       # complex
        s = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, float("nan")]), (3,),
                                    check_invariants=False)
        (s * 2).coalesce()
        m = torch.empty(4, 4, device="meta") + 1
        x = torch.randn(4, 4)
        v = x[1:3]
        v.masked_fill_(v > 0, float("inf"))                 # in-place through a view: constant infinities
        x.clamp_(max=1.0)                                   # ... made finite again in place
        parts = list(torch.split(x, 2))
        torch._foreach_mul_(parts, 2.0)
        _ = (x.sum().item(), x.shape, x.tolist(), a.sum().item(), c.abs().sum().item(), b.any().item())
        loss = x.sum()
        rec.mark_loss(loss)
    assert mode_stacks() == before
    assert len(torch.nn.modules.module._global_forward_hooks) == n_hooks
    res = rec.result()
    json.dumps(res, allow_nan=False)
    assert res["reproduced"] is False and res["n_ops"] > 10 and m.is_meta
    assert not any("recorder error" in n for n in res["notes"]), res["notes"]


def test_stop_is_idempotent_and_cleans_up_after_an_exception():
    before = mode_stacks()
    rec = OpRecorder(named_params={}, named_buffers={})
    with pytest.raises(RuntimeError):
        with rec:
            torch.randn(3) + 1
            raise RuntimeError("boom")
    rec.stop()
    rec.stop()
    assert mode_stacks() == before
    assert rec.result()["reproduced"] is False


def test_start_and_stop_from_different_call_frames_and_foreign_mode_on_top():
    """A guard starts in one hook and stops in another; a user mode pushed in between stays in place."""
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

    class UserMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    before = mode_stacks()
    rec = OpRecorder(named_params={}, named_buffers={})

    def hook_a():
        rec.start()

    def hook_b():
        rec.stop()

    hook_a()
    user = UserMode()
    user.__enter__()
    torch.ones(2) * float("nan")
    hook_b()
    assert _get_current_dispatch_mode_stack()[-1] is user
    user.__exit__(None, None, None)
    assert mode_stacks() == before


def test_many_ops_are_recorded_quickly():
    import time
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)
    rec = OpRecorder(named_params={"w": w}, named_buffers={})
    t0 = time.perf_counter()
    with rec:
        h = x
        for _ in range(400):
            h = torch.tanh(h @ w) + h * 0.5
        loss = h.pow(2).mean()
        rec.mark_loss(loss)
        rec.set_stage("backward")
        loss.backward()
    res = rec.result()
    assert res["n_ops"] > 3000
    assert time.perf_counter() - t0 < 20     # generous: shared CI machines; ~40 us/op when idle
    assert res["reproduced"] is False


def test_where_over_sqrt_at_zero_is_a_where_trap_but_plain_use_is_not():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 3)

    def fwd():
        z = net(x)
        d = (z[:, 0] - z[:, 0].detach()).pow(2)              # exactly 0 everywhere, differentiable
        r = torch.where(d > 0, torch.sqrt(d), torch.zeros_like(d))  # ORIGIN:wheresqrt
        return r.sum() + z.pow(2).mean()

    res = armed_step(net, opt, fwd)
    assert res["origin"]["autograd_node"] == "SqrtBackward0" and res["facts"]["where_trap"] is True
    check(res, phase="backward", tag="wheresqrt", category="where_gradient_trap")


def test_eigenvectors_of_a_covariance_with_dead_units_is_a_backward_division_by_a_zero_gap():
    # ZCA whitening of ReLU features: units dead over the whole batch are zero rows of the covariance, whose
    # eigenvalue 0 is repeated; eigh's backward divides by the gaps l_j - l_i (was: other, "inspect the inputs")
    torch.manual_seed(0)
    proj = torch.nn.Linear(6, 8)
    with torch.no_grad():
        proj.bias[:3] = -100.0  # three units never fire
    opt = torch.optim.SGD(proj.parameters(), lr=0.1)
    x = torch.randn(32, 6)

    def fwd():
        h = torch.relu(proj(x))
        h = h - h.mean(0, keepdim=True)
        cov = h.T @ h / (h.shape[0] - 1)
        evals, evecs = torch.linalg.eigh(cov)  # ORIGIN:eigh
        white = h @ (evecs @ torch.diag((evals + 1e-5).rsqrt()) @ evecs.T)
        return white.pow(2).mean()

    res = armed_step(proj, opt, fwd)
    assert res["origin"]["autograd_node"] == "LinalgEighBackward0", res["origin"]
    d = check(res, phase="backward", tag="eigh", category="div_by_zero")
    assert "repeated eigenvalue" in d["summary"] and "eps * I does not" in d["summary"], d["summary"]
    assert any("eigvalsh" in f for f in d["fixes"]) and any("cholesky" in f for f in d["fixes"]), d["fixes"]


def test_singular_vectors_of_a_rank_deficient_matrix_is_a_backward_division_by_a_zero_gap():
    # an orthogonal Procrustes map U @ Vh of a cross-covariance of rank 2 of 4: two singular values 0
    torch.manual_seed(0)
    enc = torch.nn.Linear(4, 4, bias=False)
    opt = torch.optim.SGD(enc.parameters(), lr=0.1)
    a = torch.zeros(16, 4)
    a[:, :2] = torch.randn(16, 2)  # two features constant (0) in this batch
    b = torch.randn(16, 4)

    def fwd():
        m = enc(b).T @ a
        u, s, vh = torch.linalg.svd(m, full_matrices=False)  # ORIGIN:svd
        return (b @ (u @ vh) - a).pow(2).mean()

    res = armed_step(enc, opt, fwd)
    assert res["origin"]["autograd_node"] == "LinalgSvdBackward0", res["origin"]
    d = check(res, phase="backward", tag="svd", category="div_by_zero")
    assert "repeated singular value" in d["summary"], d["summary"]
    assert any("svdvals" in f for f in d["fixes"]), d["fixes"]


def test_logit_of_a_rate_at_one_is_log_domain_with_the_eps_fix():
    # a click rate k / n regressed on its logit: every impression clicked gives p = 1, logit = +inf (the
    # log family's domain x <= 0 does not hold it; was: "received 0 in 0 elements", a log clamp)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 3)
    rate = torch.tensor([0.2, 0.5, 1.0, 0.3, 0.25, 0.6, 0.1, 0.4])

    def fwd():
        target = torch.logit(rate)  # ORIGIN:logit
        return torch.nn.functional.mse_loss(model(x).squeeze(-1), target)

    res = armed_step(model, opt, fwd)
    d = check(res, phase="forward", tag="logit", category="log_domain")
    assert "edge of (0, 1): 1 " in d["summary"] and "data" in d["summary"], d["summary"]
    assert any("eps=1e-6" in f for f in d["fixes"]) and any("empirical logit" in f for f in d["fixes"]), d["fixes"]
    assert not any("clamp(min=1e-12)" in f for f in d["fixes"]), d["fixes"]


def test_a_norm_at_zero_under_a_second_backward_is_named_second_order():
    # MAML's inner step (create_graph=True) through a norm of padded, exactly-0 differences: the norm's first
    # derivative is 0 there, its derivative (DivBackward0 of x / ||x||) 0/0 (was: "1 - c^2, a sine from a cosine")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(6, 3), torch.randn(6, 2)
    keep = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])[:, None]  # two padded rows

    def fwd():
        inner = torch.linalg.vector_norm((model(x) - y) * keep, dim=-1).mean()  # ORIGIN:norm2
        (g,) = torch.autograd.grad(inner, model.weight, create_graph=True)
        return ((x @ (model.weight - 0.1 * g).T - y) ** 2).mean()

    res = armed_step(model, opt, fwd)
    assert res["origin"]["autograd_node"] == "DivBackward0", res["origin"]
    d = check(res, phase="backward", tag="norm2", category="sqrt_domain")
    assert "second derivative" in d["summary"] and "cosine" not in d["summary"], d["summary"]
    assert "+ 1e-12)" in d["fixes"][0], d["fixes"]


def test_class_weights_over_a_cast_bincount_are_guarded_as_a_count():
    # "balanced" class weights n / (k * bincount(labels).float()) with a class absent: the denominator is a
    # count (whole numbers), so the guard is count.clamp(min=1), not a 1e-8 floor (a weight of ~1e10)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, labels = torch.randn(8, 4), torch.tensor([0, 2, 0, 2, 2, 0, 0, 2])   # class 1 absent

    def fwd():
        counts = torch.bincount(labels, minlength=3).float()
        weight = counts.sum() / (3 * counts)  # ORIGIN:cw
        return torch.nn.functional.cross_entropy(model(x), labels, weight=weight, label_smoothing=0.1)

    res = armed_step(model, opt, fwd)
    assert res["facts"]["zero_denominator"]["whole"] is True
    d = check(res, phase="forward", tag="cw", category="div_by_zero")
    assert "count.clamp(min=1)" in d["fixes"][0] and "1e-8" not in d["fixes"][0], d["fixes"]


def test_a_zero_price_in_the_batch_divided_by_is_named_data_not_floored():
    # log returns p[t] / p[t-1] of a price window whose feed wrote 0.0 for a missing quote: the denominator is a
    # slice of the batch itself (was: "divide by x.clamp(min=1e-8)": a fake return of ~e^20)
    torch.manual_seed(0)
    model = torch.nn.Linear(7, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prices = 100 + torch.rand(6, 8)
    prices[4, 3] = 0.0

    def fwd():
        returns = torch.log(prices[:, 1:] / prices[:, :-1])  # ORIGIN:ret
        return model(returns).pow(2).mean()

    res = armed_step(model, opt, fwd)
    assert res["origin"]["samples"] == [4], res["origin"]
    d = check(res, phase="forward", tag="ret", category="div_by_zero")
    assert "input batch itself" in d["summary"] and "missing values" in d["fixes"][0], (d["summary"], d["fixes"])


def test_a_scalar_picked_from_a_schedule_is_no_value_of_the_batch():
    # DINO's temp = teacher_temp_schedule[epoch] with warmup_teacher_temp=0.0: one 0 over the whole batch, picked
    # with a Python int (a select). It read "the input batch itself ... a gap in the feed" with batch rows 0-9
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.linspace(0.0, 0.04, 5)
    x = torch.randn(12, 4)

    def fwd():
        temp = schedule[0]
        out = torch.softmax(model(x) / temp, dim=-1)  # ORIGIN:temp
        return out.pow(2).mean()

    res = armed_step(model, opt, fwd)
    d = check(res, phase="forward", tag="temp", category="div_by_zero")
    assert "input batch itself" not in d["summary"] and "gap in the feed" not in d["fixes"][0], d["fixes"]
    assert "schedule" in d["fixes"][0], d["fixes"]


def test_a_deviance_log_of_a_zero_count_over_the_rate_offers_xlogy():
    # the Poisson deviance y * log(y / mu) written out: an hour with no calls is 0 * log(0) = NaN
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 3), torch.tensor([3.0, 1.0, 0.0, 2.0, 5.0, 1.0, 4.0, 2.0])

    def fwd():
        mu = torch.exp(model(x).squeeze(-1))
        return 2 * (y * torch.log(y / mu) - (y - mu)).mean()  # ORIGIN:dev

    res = armed_step(model, opt, fwd)
    d = check(res, phase="forward", tag="dev", category="log_domain")
    assert any("torch.xlogy(y, y / mu)" in f for f in d["fixes"]), d["fixes"]


def test_an_in_place_scatter_sum_that_overflows_float16_is_read_on_the_values_it_read():
    # GIN's sum aggregation under float16: zeros_like(x).index_add_(0, dst, x[src]) over a star graph's 1200
    # leaves; the in-place op's own input was read after it wrote (inf), so the float64 re-run added onto inf
    # and read "a pole" (was: other)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).half()
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)
    x = torch.full((1201, 4), 2.0, dtype=torch.float16)
    src = torch.arange(1, 1201)
    dst = torch.zeros(1200, dtype=torch.long)

    def fwd():
        h = torch.relu(lin(x)) + 60.0
        agg = torch.zeros_like(h).index_add_(0, dst, h[src])  # ORIGIN:scatter
        return agg.float().mean()

    res = armed_step(lin, opt, fwd)
    o = res["origin"]
    assert o["op"] == "aten.index_add_.default" and o["inputs"][0]["nonfinite"] == 0, o["inputs"]
    assert res["facts"]["float64_check"]["finite"] is True, res["facts"]["float64_check"]
    check(res, phase="forward", tag="scatter", category="low_precision_overflow")

