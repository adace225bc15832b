"""The exp_overflow fixes for a hand-written NT-Xent (the widely copied SimCLR ContrastiveLoss:
``nominator = torch.exp(positives / self.temperature)`` ... ``-torch.log(nominator / torch.sum(denominator, dim=1))``)
at temperature 0.01: exp(1 / 0.01) = exp(100) overflows. The old fix clamped the divisor
(``positives / self.temperature.clamp(-20.0, 20.0)``: operator precedence) and offered no log-softmax form; now
the exp's normalisation on a later line makes it a hand-written softmax (log_softmax / cross_entropy fixes), the
summary names the quotient, and a clamp of a compound expression is parenthesised."""
from nanguard.core.diagnosis import diagnose
from nanguard.core.diagnosis import fixes as X

NTXENT = '''import torch
class ContrastiveLoss:
    def forward(self, positives, similarity_matrix):
        nominator = torch.exp(positives / self.temperature)
        denominator = self.negatives_mask * torch.exp(similarity_matrix / self.temperature)

        loss_partial = -torch.log(nominator / torch.sum(denominator, dim=1))
        return loss_partial.sum()
'''

VAE = '''import torch
def reparameterize(mu, logvar):
    std = torch.exp(0.5 * logvar)
    eps = torch.randn_like(std)
    return mu + eps * std
'''


def _loc(path, line, mx):
    origin = {"op": "aten.exp.default", "api": "torch.exp", "file": str(path), "line": line, "dtype": "float32",
              "module": "", "stage": "forward", "inputs": [{"max_abs": mx, "nonfinite": False, "dtype": "float32"}],
              "output": {"posinf": 2, "nan": 0, "neginf": 0}}
    return {"reproduced": True, "origin": origin, "phase": "forward", "n_ops": 9,
            "facts": {"exp_input_max": mx, "overflow_threshold": 88.72}}


HIST = [{"step": 0, "loss": None, "grad_norm": None, "param_norm": 3.0, "lr": [3e-4], "skipped": False}]


def test_ntxent_split_over_lines_gets_the_log_softmax_fix(tmp_path):
    f = tmp_path / "ntxent.py"
    f.write_text(NTXENT)
    out = diagnose(_loc(f, 4, 100.0), HIST[:0], phase="forward", context={"optimizer": "Adam"})
    assert out["category"] == "exp_overflow", out["summary"]
    assert not any("self.temperature.clamp" in x for x in out["fixes"]), out["fixes"]   # old code: clamped the divisor
    assert any("F.cross_entropy" in x or "log_softmax" in x for x in out["fixes"]), out["fixes"]
    assert "quotient positives / self.temperature" in out["summary"], out["summary"]
    assert out["fixes"][-1].startswith("bound the divisor self.temperature"), out["fixes"]  # not "bound the logits"


def test_an_exp_of_a_predicted_log_variance_keeps_the_bound_fix(tmp_path):
    f = tmp_path / "vae.py"
    f.write_text(VAE)
    out = diagnose(_loc(f, 3, 120.0), HIST[:0], phase="forward", context={"optimizer": "Adam"})
    assert out["category"] == "exp_overflow"
    assert any("torch.exp((0.5 * logvar).clamp(-20.0, 20.0))" in x for x in out["fixes"]), out["fixes"]


def test_clamp_parenthesises_a_compound_receiver():
    assert X.clamp("positives / self.temperature", "-20.0", "20.0").startswith("(positives / self.temperature).clamp(")
    assert X.clamp("logvar[:, 0]", "-20.0", "20.0").startswith("logvar[:, 0].clamp(")
    assert X.clamp_min("x", "1e-12").startswith("x.clamp(min=1e-12)")


KL = '''import torch
def kl(z_mean, z_log_var):
    kl_loss = -0.5 * (1 + z_log_var - z_mean ** 2 - torch.exp(z_log_var))
    kl_loss = torch.mean(torch.sum(kl_loss, dim=1))
    return kl_loss
'''


def test_an_exp_that_is_a_term_of_a_kl_is_no_softmax_though_its_line_is_summed_later(tmp_path):
    """The Keras VAE's KL (1 + v - m^2 - exp(v)), summed on the next line, read as a hand-written softmax split
    over lines ('replace the hand-written exp(z)/sum(exp(z)) by softmax')."""
    f = tmp_path / "kl.py"
    f.write_text(KL)
    out = diagnose(_loc(f, 3, 90.1), HIST[:0], phase="forward", context={"optimizer": "Adam"})
    assert out["category"] == "exp_overflow"
    assert not any("softmax" in x for x in out["fixes"]) and "clamp(-20.0, 20.0)" in out["fixes"][0], out["fixes"]


SOFTPLUS = '''import torch
def heads(h, sigma_layer):
    alpha = torch.log(1 + torch.exp(sigma_layer(h))) + 1e-6
    return alpha
'''


def test_a_hand_written_softplus_gets_softplus(tmp_path):
    """DeepAR's dispersion head log(1 + exp(z)) overflows for z > 88.7: F.softplus computes the same safely (a clamp
    of z at 20 would cap the head near 20 for a store selling thousands a day)."""
    f = tmp_path / "deepar.py"
    f.write_text(SOFTPLUS)
    out = diagnose(_loc(f, 3, 342.0), HIST[:0], phase="forward", context={"optimizer": "Adam"})
    assert out["category"] == "exp_overflow" and "hand-written softplus" in out["summary"]
    assert out["fixes"][0].startswith("use F.softplus(sigma_layer(h))"), out["fixes"]


COX = '''import torch
def partial_likelihood(risk, event):
    log_risk_set = torch.log(torch.cumsum(torch.exp(risk), dim=0))
    return -((risk - log_risk_set) * event).sum()
'''


def test_a_cumulative_sum_of_exps_gets_logcumsumexp(tmp_path):
    """DeepSurv's Cox partial likelihood log(cumsum(exp(risk))) overflows once a score passes 88.7: the running
    log-sum-exp is torch.logcumsumexp (a softmax rewrite does not apply: there is no normalised exp)."""
    f = tmp_path / "cox.py"
    f.write_text(COX)
    out = diagnose(_loc(f, 3, 113.0), HIST[:0], phase="forward", context={"optimizer": "Adam"})
    assert out["category"] == "exp_overflow" and "cumulative sum of exps" in out["summary"]
    assert out["fixes"][0].startswith("use torch.logcumsumexp(risk, dim)"), out["fixes"]
    assert not any("softmax" in x for x in out["fixes"])


ENTROPY = '''import torch
def step(q):
    conf = -torch.xlogy(q, q).sum(1).mean()
    return conf
'''


def test_an_entropy_written_as_xlogy_gets_the_logits_form_not_a_log_clamp(tmp_path):
    """Soft k-means annealing its temperature: the softmax underflows to exactly 0 and xlogy(q, q) is 0 there, but
    its backward reads q / q = 0/0. The log templates ("log_softmax instead of log(softmax)", "torch.log(x.clamp)")
    named code the script does not have."""
    f = tmp_path / "kmeans.py"
    f.write_text(ENTROPY)
    origin = {"op": "aten.div.Tensor", "file": str(f), "line": 3, "dtype": "float32", "stage": "backward",
              "autograd_node": "XlogyBackward0", "forward_op": "aten.xlogy.Tensor", "forward_file": str(f),
              "forward_line": 3, "forward_api": "torch.xlogy", "shape": [128, 8],
              "inputs": [{"dtype": "float32", "numel": 1024, "min": 0.0, "max": 1.0, "zeros": 6, "negatives": 0,
                          "nonfinite": 0, "arg": 0}], "output": {"nan": 6, "posinf": 0, "neginf": 0}}
    loc = {"reproduced": True, "phase": "backward", "n_ops": 9, "sink": {"kind": "grad"}, "preexisting": None,
           "origin": origin, "facts": {"log_domain": {"le_limit": 6, "negatives": 0}, "producers": [["_softmax"]]}}
    out = diagnose(loc, [], phase="backward", context={"optimizer": "Adam"})
    assert out["category"] == "log_domain"
    assert "log_softmax(z, -1)" in out["fixes"][0] and "Categorical(logits=z)" in out["fixes"][0], out["fixes"]
    assert not any("torch.log(x.clamp" in x or "instead of log(softmax)" in x for x in out["fixes"]), out["fixes"]


MOE = '''import torch
class SparseDispatcher:
    def combine(self, expert_out):
        stitched = torch.cat(expert_out, 0).exp()
        stitched = stitched.mul(self._nonzero_gates)
        zeros = torch.zeros(self._gates.size(0), expert_out[-1].size(1))
        combined = zeros.index_add(0, self._batch_index, stitched.float())
        return combined.log()
'''


def test_exps_summed_then_logged_are_a_log_sum_exp_not_a_softmax(tmp_path):
    """A mixture of experts' combine (exp, gate-weighted index_add, log) fed regression outputs above 88.7: it read
    'replace the hand-written exp(z)/sum(exp(z)) by torch.softmax', a rewrite of a different function."""
    f = tmp_path / "moe.py"
    f.write_text(MOE)
    out = diagnose(_loc(f, 4, 99.1), HIST[:0], phase="forward", context={"optimizer": "Adam"})
    assert out["category"] == "exp_overflow" and "log-sum-exp written out" in out["summary"]
    assert "logsumexp(z + torch.log(w)" in out["fixes"][0] and not any("softmax" in x for x in out["fixes"])
    f = tmp_path / "moe_unsummed.py"  # (a new name: linecache keeps the first file's lines)
    f.write_text(MOE.replace("        return combined.log()\n", "        return combined.log() - torch.log(3.0)\n"
                             ).replace("index_add(0, self._batch_index, stitched.float())", "stitched.float()"))
    out = diagnose(_loc(f, 4, 99.1), HIST[:0], phase="forward", context={"optimizer": "Adam"})
    assert "log-sum-exp" not in out["summary"]  # nothing summed: no log-sum-exp
