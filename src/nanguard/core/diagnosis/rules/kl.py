"""F.kl_div misuse (generic: the kl_div facts come from the enclosing API call, whatever the aten op):
log-probabilities passed as target with log_target=False."""
from __future__ import annotations

from .. import families as F
from .. import fixes as X
from .. import text as T


@F.generic_rule(600, categories=("kl_misuse",))
def _kl_rule(c) -> dict | None:
    kl = c.facts.get("kl_div")
    if kl and not kl.get("log_target") and (kl.get("target_all_le_0") or kl.get("target_negatives")):
        return kl_result(c.origin, kl, c.ev, c.method)
    return None


def kl_result(origin: dict, kl: dict, ev: dict, method: str) -> dict:
    where = T.where(origin)
    api = X.say(pytorch="F.kl_div", tensorflow="F.kl_div", jax="optax.kl_divergence")
    summ = (f"{api} at {where} got a target in [{T.g(kl.get('target_min'))}, {T.g(kl.get('target_max'))}] "
            f"({kl.get('target_negatives')} negative values"
            + (", rows logsumexp to 0: log-probabilities" if kl.get("target_looks_like_log_probs") else "")
            + X.say(pytorch=") with log_target=False", tensorflow=") with log_target=False",
                    jax=", which expects probabilities)") + ", so target * log(target) is NaN")
    fixes = [X.say(pytorch=f"pass log_target=True at {where}: F.kl_div(logp, logq, reduction='batchmean', "
                   "log_target=True)", tensorflow=f"pass log_target=True at {where}: F.kl_div(logp, logq, "
                   "reduction='batchmean', log_target=True)",
                   jax=f"use optax.kl_divergence_with_log_targets(log_predictions, log_targets) at {where}"),
             X.say(pytorch="or give probabilities as target: F.kl_div(logp, logq.exp(), reduction='batchmean')",
                   tensorflow="or give probabilities as target: F.kl_div(logp, logq.exp(), reduction='batchmean')",
                   jax="or give probabilities as targets: optax.kl_divergence(log_predictions, jnp.exp(log_targets))")]
    return T.result("kl_misuse", summ, 0.93, ev, fixes, method)
