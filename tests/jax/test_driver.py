"""The JAX driver in-process (``nanguard.jax.watch``): steps counted as the JAX scenario format says (outermost
optax updates), phases, the flag vector returned by the jitted step, the four step shapes, recovery, and a
healthy jitted run trained bit-for-bit as without the guard."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import nanguard.jax as ngjax  # noqa: E402
from nanguard.core.events import NonFiniteError, Report  # noqa: E402
from nanguard.jax import hooks  # noqa: E402

X = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
Y = (X @ np.array([0.5, -1.0, 0.3, 2.0], np.float32)).astype(np.float32)


def _plain(loss_fn, tx, steps, batch=lambda i: (X, Y), params=None, jit=True):
    """A plain JAX + optax loop; returns the params and the losses."""
    params = params if params is not None else {"w": jnp.zeros(4), "b": jnp.array(0.0)}
    opt_state = tx.init(params)

    def train_step(params, opt_state, xb, yb):
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    step = jax.jit(train_step) if jit else train_step
    losses = []
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, *batch(i))
        losses.append(float(loss))
    return params, losses


def mse(p, xb, yb):
    return jnp.mean((xb @ p["w"] + p["b"] - yb) ** 2)


def test_healthy_jitted_run_is_bit_for_bit_and_counts_every_update():
    def tx():
        return optax.chain(optax.clip_by_global_norm(1e6), optax.adam(1e-2))
    ref, ref_losses = _plain(mse, tx(), 12)
    with ngjax.watch(report=None, quiet=True) as drv:
        got, losses = _plain(mse, tx(), 12)
    assert hooks.HOST[0] is None and jax.jit is hooks._ORIG.get("jit", jax.jit)  # uninstalled
    for k in ref:
        assert np.asarray(ref[k]).tobytes() == np.asarray(got[k]).tobytes()
    assert losses == ref_losses
    rep = drv.report
    assert rep.status == "clean" and rep.steps_watched == 12  # a chain's inner transforms are not counted
    assert [h["loss"] for h in rep.history] == pytest.approx(losses)
    assert all(h["grad_norm"] > 0 and h["param_norm"] is None or h["param_norm"] >= 0 for h in rep.history)


def test_forward_failure_stops_at_the_next_call_with_the_step_and_the_origin():
    def rate_nll(p, xb, yb):  # b: 1.0 -> 0.6 -> -0.07: the rate max(b, 0) reaches 0 at step 2
        rate = jnp.maximum(p["b"] + 0.0 * xb[:, 0], 0.0)
        return jnp.mean(jnp.log(rate)) + 0.0 * jnp.sum(p["w"])
    params = {"w": jnp.zeros(4), "b": jnp.array(1.0)}
    with pytest.raises(NonFiniteError) as ei:
        with ngjax.watch(report=None, quiet=True):
            _plain(rate_nll, optax.sgd(0.4), 6, params=params)
    rep = ei.value.report
    ev = rep.events[0]
    assert (ev.step, ev.phase) == (2, "forward")
    assert rep.steps_watched == 3  # the next update never ran
    assert ev.cause["category"] == "log_domain"


def test_nan_in_the_batch_is_the_data_phase_with_its_row():
    xb_bad = X.copy()
    xb_bad[5, 2] = np.nan
    with pytest.raises(NonFiniteError) as ei:
        with ngjax.watch(report=None, quiet=True):
            _plain(mse, optax.adam(1e-2), 8, batch=lambda i: (xb_bad if i == 4 else X, Y))
    ev = ei.value.report.events[0]
    assert (ev.step, ev.phase) == (4, "data")
    assert ev.detected["inputs"][0]["rows"] == [5]
    assert ev.cause["category"] == "bad_input_data"


def test_gradient_only_failure_is_backward_and_apply_if_finite_skips_are_not_failures():
    def norm_loss(p, xb, yb):  # the norm of a zero vector: finite loss, NaN gradient
        return jnp.linalg.norm(p["w"]) + jnp.mean((xb @ p["w"] - yb) ** 2) * 0.0
    params = {"w": jnp.zeros(4), "b": jnp.array(0.0)}
    with ngjax.watch(report=None, quiet=True, on_nonfinite="warn") as drv:
        _plain(norm_loss, optax.sgd(0.1), 3, params=params)
    assert (drv.report.events[0].step, drv.report.events[0].phase) == (0, "backward")
    with ngjax.watch(report=None, quiet=True) as drv:
        _plain(norm_loss, optax.apply_if_finite(optax.sgd(0.1), 10), 3, params=params)
    assert drv.report.status == "clean" and drv.report.steps_watched == 3  # dropped updates still count
    assert len(drv.report.info) == 3
    # past max_consecutive_errors apply_if_finite applies the update: that one is the failure (it was an
    # information-only skip, and the NaN weights were named at the next step as corrupted parameters)
    with ngjax.watch(report=None, quiet=True, on_nonfinite="warn") as drv:
        _plain(norm_loss, optax.apply_if_finite(optax.sgd(0.1), 2), 4, params=params)
    ev = drv.report.events[0]
    assert (ev.step, ev.phase) == (2, "backward"), (ev.step, ev.phase)
    assert [h["skipped"] for h in drv.report.history][:3] == [True, True, False]


def test_eager_updates_are_checked_too():
    xb_bad = X.copy()
    xb_bad[0, 0] = np.inf
    with ngjax.watch(report=None, quiet=True, on_nonfinite="warn") as drv:
        _plain(mse, optax.adam(1e-2), 4, batch=lambda i: (xb_bad if i == 2 else X, Y), jit=False)
    assert drv.report.steps_watched == 4
    ev = drv.report.events[0]
    assert (ev.step, ev.phase, ev.detected["inputs"][0]["rows"]) == (2, "data", [0])  # the eager grad call's inputs
    with pytest.raises(NonFiniteError) as ei:  # stop mode: the next eager update does not run
        with ngjax.watch(report=None, quiet=True):
            _plain(mse, optax.adam(1e-2), 6, batch=lambda i: (xb_bad if i == 2 else X, Y), jit=False)
    assert ei.value.report.steps_watched == 3 and ei.value.report.events[0].step == 2


@pytest.mark.parametrize("apply", ["optax", "by_hand"])
def test_recover_skips_the_failing_update_in_the_graph(apply):
    """``optax``: the gate reads the new parameters where optax.apply_updates makes them (the update stays
    fused: bit for bit, tests/jax/test_bitwise_healthy.py); ``by_hand``: a step that applies the update with a
    tree_map of its own is traced again with the gate inside the update."""
    xb_bad = X.copy()
    xb_bad[3, 1] = np.nan
    seen = {}

    def batch(i):
        return (xb_bad if i == 5 else X, Y)
    ref, _ = _plain(mse, optax.adam(1e-2), 5)
    with ngjax.watch(report=None, quiet=True, recover="auto") as drv:
        add = optax.apply_updates if apply == "optax" else \
            (lambda p, u: jax.tree_util.tree_map(lambda a, b: a + b, p, u))
        params = {"w": jnp.zeros(4), "b": jnp.array(0.0)}
        tx = optax.adam(1e-2)
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, xb, yb):
            loss, grads = jax.value_and_grad(mse)(params, xb, yb)
            updates, opt_state = tx.update(grads, opt_state, params)
            return add(params, updates), opt_state, loss
        for i in range(8):
            params, opt_state, loss = step(params, opt_state, *batch(i))
            seen[i] = params
    rep = drv.report
    assert step._inline[0] is (apply == "by_hand")  # (traced again with the gate in the update)
    assert rep.status == "recovered" and rep.events[0].step == 5 and "skip_step" in rep.events[0].recovery["action"]
    for k in ref:  # step 5's update never reached the parameters; 0..4 are the unguarded run's
        assert np.asarray(seen[5][k]).tobytes() == np.asarray(seen[4][k]).tobytes()
        assert np.asarray(seen[4][k]).tobytes() == np.asarray(ref[k]).tobytes()
        assert np.all(np.isfinite(np.asarray(params[k])))


def test_nnx_equinox_and_linen_steps_are_counted_and_localized():
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    xb_bad = X.copy()
    xb_bad[7, 0] = np.nan

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(4, 8, rngs=rngs)
            self.out = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))[:, 0]

    with pytest.raises(NonFiniteError) as ei:
        with ngjax.watch(report=None, quiet=True):
            model = Net(nnx.Rngs(0))
            opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

            @nnx.jit
            def nstep(model, opt, xb, yb):
                loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(xb) - yb) ** 2))(model)
                opt.update(model, grads)
                return loss
            for i in range(6):
                nstep(model, opt, jnp.asarray(xb_bad if i == 3 else X), jnp.asarray(Y))
    ev = ei.value.report.events[0]
    assert (ev.step, ev.phase, ev.cause["category"]) == (3, "data", "bad_input_data")
    assert ev.localization.get("reproduced") or ev.localization.get("method_kind") == "replay"

    with ngjax.watch(report=None, quiet=True, on_nonfinite="warn") as drv:
        mlp = eqx.nn.MLP(4, "scalar", 8, 1, key=jax.random.PRNGKey(0))
        tx = optax.sgd(1e-2)
        st = tx.init(eqx.filter(mlp, eqx.is_array))

        @eqx.filter_jit
        def estep(model, st, xb, yb):
            loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jnp.sqrt(jax.vmap(m)(xb) - yb)))(model)
            updates, st = tx.update(grads, st, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), st, loss
        for _ in range(3):
            mlp, st, _loss = estep(mlp, st, X, Y)
    assert drv.report.steps_watched == 3 and drv.report.events[0].step == 0
    assert drv.report.events[0].phase == "forward"


def test_donated_buffers_stay_readable_and_results_match():
    ref, _ = _plain(mse, optax.sgd(1e-2), 4)
    with ngjax.watch(report=None, quiet=True) as drv:
        params = {"w": jnp.zeros(4), "b": jnp.array(0.0)}
        tx = optax.sgd(1e-2)
        st = tx.init(params)

        def train_step(params, st, xb, yb):
            loss, grads = jax.value_and_grad(mse)(params, xb, yb)
            updates, st = tx.update(grads, st, params)
            return optax.apply_updates(params, updates), st, loss
        step = jax.jit(train_step, donate_argnums=(0, 1))
        for _ in range(4):
            params, st, _loss = step(params, st, X, Y)
    assert drv.report.steps_watched == 4
    for k in ref:
        assert np.asarray(ref[k]).tobytes() == np.asarray(params[k]).tobytes()


def test_updates_inside_lax_scan_are_counted_through_a_callback():
    xs = np.stack([X] * 5)
    xs[2, 1, 1] = np.nan
    with ngjax.watch(report=None, quiet=True, on_nonfinite="warn") as drv:
        tx = optax.sgd(1e-2)
        params = {"w": jnp.zeros(4), "b": jnp.array(0.0)}

        @jax.jit
        def many(params, st, xs):
            def body(carry, xb):
                p, s = carry
                loss, g = jax.value_and_grad(mse)(p, xb, Y)
                u, s = tx.update(g, s, p)
                return (optax.apply_updates(p, u), s), loss
            return jax.lax.scan(body, (params, st), xs)
        (params, _st), losses = many(params, tx.init(params), xs)
        np.asarray(losses)
    rep = drv.report
    assert rep.steps_watched == 5
    assert (rep.events[0].step, rep.events[0].phase) == (2, "forward")  # the loss of the scan body is seen


def test_lr_backoff_and_clip_act_in_the_retraced_step():
    from nanguard.jax.recover import JaxActions
    with ngjax.watch(report=None, quiet=True, recover="auto") as drv:
        tx = optax.sgd(0.1)
        params = {"w": jnp.ones(4), "b": jnp.array(0.0)}
        st = tx.init(params)

        @jax.jit
        def step(params, st, xb, yb):
            loss, grads = jax.value_and_grad(mse)(params, xb, yb)
            updates, st = tx.update(grads, st, params)
            return optax.apply_updates(params, updates), st, loss
        d1 = np.asarray(step(params, st, X, Y)[0]["w"] - params["w"])
        acts = JaxActions(drv.recovery)
        rec = acts.lr_backoff(0.5)
        d2 = np.asarray(step(params, st, X, Y)[0]["w"] - params["w"])
        acts.clip_gradients(1e-3)
        d3 = np.asarray(step(params, st, X, Y)[0]["w"] - params["w"])
    assert rec["factor"] == 0.5 and rec["lr_after"] == [0.05]
    np.testing.assert_allclose(d2, 0.5 * d1, rtol=1e-5)
    assert np.linalg.norm(d3) == pytest.approx(0.05 * 1e-3, rel=1e-2)


def test_a_block_that_saw_no_update_says_so():
    with pytest.warns(RuntimeWarning, match="saw no optimizer update"):
        with ngjax.watch(report=None, quiet=True) as drv:  # gradients, but no optax update in the block
            jax.jit(jax.grad(mse))({"w": jnp.zeros(4), "b": jnp.array(0.0)}, X, Y)
    rep = drv.report
    assert rep.steps_watched == 0
    # nothing was checked: not "clean" (a hand-written update's NaN run was called clean, 0 steps watched)
    assert rep.status == "unwatched" and "no optax update" in rep.unwatched
    assert rep.as_dict()["unwatched"] == rep.unwatched and Report.from_dict(rep.as_dict()).status == "unwatched"


def test_multisteps_is_the_outermost_update_and_a_skip_keeps_its_accumulator():
    """optax.MultiSteps (a class, not a transform GradientTransformation builds): its own update is checked, so
    each micro-step's loss is read and a failure is the micro-step's; recovery's skip keeps the old MultiSteps
    state, accumulator included (a skip of the inner optimizer's update alone left the NaN gradients in the
    accumulator, and the next micro-steps failed too). Healthy micro-steps are bit for bit the plain ones."""
    xb_bad = X.copy()
    xb_bad[2, 0] = np.nan

    def batch(i):
        return (xb_bad if i == 6 else X, Y)

    def tx():
        return optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4)
    ref, ref_losses = _plain(mse, tx(), 6)
    with ngjax.watch(report=None, quiet=True, on_nonfinite="warn") as drv:
        got, losses = _plain(mse, tx(), 6)
    assert losses == ref_losses and all(np.asarray(got[k]).tobytes() == np.asarray(ref[k]).tobytes() for k in ref)
    assert drv.report.steps_watched == 6 and all(h["loss"] is not None for h in drv.report.history)
    with ngjax.watch(report=None, quiet=True, recover="auto") as drv:
        params, losses = _plain(mse, tx(), 14, batch=batch)
    rep = drv.report
    assert rep.status == "recovered" and rep.events[0].step == 6 and rep.events[0].phase == "data", rep.events[0]
    assert len(rep.events) == 1 and all(np.isfinite(losses[7:])), losses  # no NaN left in the accumulator
    assert all(np.all(np.isfinite(np.asarray(params[k]))) for k in params)


def test_a_skip_puts_back_what_the_step_carries_besides_the_parameters():
    """A running statistic the step updates from its batch (BatchNorm's batch_stats) was left NaN by a skip (the
    gate covers the parameters and the optimizer state only), and every later failure was misread. The next call
    gets the failing call's own value back."""
    xb_bad = X.copy()
    xb_bad[1, 2] = np.inf
    with ngjax.watch(report=None, quiet=True, recover="auto") as drv:
        params, stats = {"w": jnp.zeros(4), "b": jnp.array(0.0)}, jnp.zeros(4)
        tx = optax.adam(1e-2)
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, stats, xb, yb):
            stats = 0.9 * stats + 0.1 * xb.mean(0)
            loss, grads = jax.value_and_grad(mse)(params, (xb - stats) / 2.0, yb)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, stats, loss
        for i in range(8):
            params, opt_state, stats, loss = step(params, opt_state, stats, xb_bad if i == 3 else X, Y)
    rep = drv.report
    assert rep.status == "recovered" and [e.step for e in rep.events] == [3], [(e.step, e.phase) for e in rep.events]
    assert rep.events[0].recovery["actions"]["skip_step"].get("carried_restored") is True
    assert np.all(np.isfinite(np.asarray(stats))) and np.isfinite(float(loss))


def test_recovery_still_sees_an_optimizer_state_that_overflowed():
    """Recovery returns the old optimizer state for a failing update, while the check reads the update's own new
    state: an Adam second moment past float16's range is a failure of its step, and the state the step returns
    is the old, finite one."""
    with ngjax.watch(report=None, quiet=True, recover="auto", on_nonfinite="warn") as drv:
        params = {"w": jnp.ones(4, jnp.float16)}
        tx = optax.scale_by_adam()
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, g):
            loss, grads = jax.value_and_grad(lambda p: jnp.sum(p["w"].astype(jnp.float32) * g.astype(jnp.float32)))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, jax.tree_util.tree_map(lambda u: -1e-3 * u, updates)), opt_state, loss
        for i in range(4):
            g = jnp.full(4, 30000.0 if i == 2 else 1.0, jnp.float16)  # (1 - b2) * 30000^2 = 9e5: past 65504
            params, opt_state, loss = step(params, opt_state, g)
    rep = drv.report
    assert rep.events and rep.events[0].step == 2, [(e.step, e.phase) for e in rep.events]
    assert np.all(np.isfinite(np.asarray(opt_state.nu["w"])))  # the kept state



def test_os_exit_ends_the_run_with_its_report(tmp_path):
    """``os._exit`` runs no ``finally``: the report stayed "running". The run ends inside it now."""
    import json
    import subprocess
    import sys
    s = tmp_path / "e.py"
    s.write_text("import os\nimport jax.numpy as jnp\nimport optax\n"
                 "tx = optax.sgd(0.1)\np = {'w': jnp.ones(3)}\ns = tx.init(p)\n"
                 "for _ in range(3):\n    u, s = tx.update({'w': jnp.ones(3)}, s, p)\n    p = optax.apply_updates(p, u)\n"
                 "os._exit(6)\n")
    rep = tmp_path / "e.json"
    out = subprocess.run([sys.executable, "-m", "nanguard", "run", "--report", str(rep), "--no-bundle", "--no-html",
                          str(s)], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    data = json.loads(rep.read_text())
    assert out.returncode == 6 and data["status"] == "exited" and data["exit_code"] == 6, out.stderr[-2000:]
    assert data["steps_watched"] == 3


def test_a_schedules_rate_is_read_into_the_history():
    """``optax.sgd(schedule)`` holds no rate in its state (only ``inject_hyperparams`` does): the history's lr was
    unknown, and a schedule that multiplied the rate x10 read as "a hard or mislabelled batch". The schedule is
    evaluated at the count its state holds before each update."""
    sched = optax.piecewise_constant_schedule(0.01, {2: 10.0})
    with ngjax.watch(report=None, quiet=True) as drv:
        _plain(mse, optax.sgd(sched, momentum=0.9), 4)
    assert [h["lr"] for h in drv.report.history] == [[pytest.approx(0.01)]] * 2 + [[pytest.approx(0.1)]] * 2
