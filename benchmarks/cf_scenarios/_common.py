"""Shared loop for the Guard-driven scenarios: train, stop at the first failure, write the report."""
import sys

import nanguard


def train(model, opt, loss_fn, batches, steps, **guard_kw):
    """``batches(step)`` gives the step's batch; ``REPORT`` is argv[1]."""
    report = sys.argv[1] if len(sys.argv) > 1 else "nanguard_report.json"
    g = nanguard.Guard(model, opt, report=report, bundle=None, html=None, quiet=True, **guard_kw)
    losses = []
    try:
        for i in range(steps):
            b = batches(i)
            loss = g.step(b, loss_fn)
            losses.append(float(loss))
            print(f"step={i} loss={losses[-1]:.6f}")
    except nanguard.NonFiniteError:
        pass
    g.close()
