"""Counterfactual experiments on the failing step, framework-neutral: "the NaN goes away when X".

A diagnosis names a cause from the ops, the values and the history; an experiment *tests* it by
replaying the failing step with one change and seeing whether the failure is gone: the step without
batch row 3, module ``enc.1`` in float32, the whole step in float64, the learning rate x0.1 from
the snapshot two steps back, the same step twice... This package decides which experiments to run
and what they mean; a backend executes them on its replayable step.

* :mod:`.records` - :class:`Spec` (a change to try) and :class:`Experiment` (what it gave);
* :mod:`.kinds` - the experiment kinds: cost, what a finite / non-finite outcome confirms or
  refutes, which recovery action a finite outcome verifies;
* :mod:`.planner` - the experiments that test a category, cheapest first;
* :mod:`.investigate` - :func:`investigate`: the loop over hypotheses within a time budget, and
  :class:`Bench`, what a backend implements;
* :mod:`.implied` - the cause an experiment proves when it refutes the leading one;
* :mod:`.verdict` - the report fields (``cause.confirmed_by``, ``cause.ruled_out``,
  ``cause.evidence.experiments``) and the confidence;
* :mod:`.tested` - ``cause.tested_fixes``: the numeric fixes the replays tried, and what they gave;
* :mod:`.reconcile` - the numbered fixes reworded, ordered and marked by what the replays showed;
* :mod:`.calibration` - the calibration table (confidence bucket -> share right);
* :mod:`.config` - :class:`ExperimentConfig` (``experiments=``).

The PyTorch bench is :mod:`nanguard.pytorch.experiments`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..exports import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from .config import ExperimentConfig
    from .investigate import Bench, investigate
    from .kinds import DIVERGENCE, EXACT, KINDS, PER_SAMPLE, PRECISION, judge
    from .planner import Situation, plan
    from .records import Experiment, Spec
    from .verdict import CONFIRMED, NEEDS_PROOF

__all__ = ["Bench", "CONFIRMED", "DIVERGENCE", "EXACT", "Experiment", "ExperimentConfig", "KINDS", "NEEDS_PROOF",
           "PER_SAMPLE", "PRECISION", "Situation", "Spec", "investigate", "judge", "plan"]

# imported on first use (a healthy run does not load this package's modules)
__getattr__, __dir__ = lazy_exports(__name__, {
    "ExperimentConfig": ".config", "Bench": ".investigate", "investigate": ".investigate", "DIVERGENCE": ".kinds",
    "EXACT": ".kinds", "KINDS": ".kinds", "PER_SAMPLE": ".kinds", "PRECISION": ".kinds", "judge": ".kinds",
    "Situation": ".planner", "plan": ".planner", "Experiment": ".records", "Spec": ".records",
    "CONFIRMED": ".verdict", "NEEDS_PROOF": ".verdict"})
