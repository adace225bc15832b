"""F.kl_div misuse (generic: the kl_div facts come from the enclosing API call, whatever the aten op):
log-probabilities passed as target with log_target=False."""
from __future__ import annotations

from .. import families as F
from .. import text as T


@F.generic_rule(600, categories=("kl_misuse",))
def _kl_rule(c) -> dict | None:
    kl = c.facts.get("kl_div")
    if kl and not kl.get("log_target") and (kl.get("target_all_le_0") or kl.get("target_negatives")):
        return kl_result(c.origin, kl, c.ev, c.method)
    return None


def kl_result(origin: dict, kl: dict, ev: dict, method: str) -> dict:
    where = T.where(origin)
    summ = (f"F.kl_div at {where} got a target in [{T.g(kl.get('target_min'))}, {T.g(kl.get('target_max'))}] "
            f"({kl.get('target_negatives')} negative values"
            + (", rows logsumexp to 0: log-probabilities" if kl.get("target_looks_like_log_probs") else "")
            + ") with log_target=False, so target * log(target) is NaN")
    fixes = [f"pass log_target=True at {where}: F.kl_div(logp, logq, reduction='batchmean', log_target=True)",
             "or give probabilities as target: F.kl_div(logp, logq.exp(), reduction='batchmean')"]
    return T.result("kl_misuse", summ, 0.93, ev, fixes, method)
