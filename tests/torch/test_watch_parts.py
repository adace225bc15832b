"""The Watcher's parts are declared constructor parameters (issue 21): the observer's named hooks in
the order a training step calls them, several observers in order, the recovery policy attached by
the Watcher (a weak reference back), the localization's re-run told which bundle to write."""
from __future__ import annotations

import torch

import nanguard
from nanguard.core.events import Detection
from nanguard.pytorch.observer import Observers, WatchObserver, combine
from nanguard.pytorch.recover import RecoveryPolicy
from nanguard.pytorch.watch import Watcher
from nanguard.pytorch.zerocode import LocalizeSpec


class Log(WatchObserver):
    def __init__(self, name="", calls=None):
        self.name, self.calls = name, calls if calls is not None else []

    def _log(self, what):
        self.calls.append(self.name + what)

    def step_start(self, watcher, step):
        self._log(f"step_start {step}")

    def data_begin(self, watcher):
        self._log("data_begin")

    def data_end(self, watcher):
        self._log("data_end")

    def backward_begin(self, watcher, losses):
        assert len(losses) == 1 and losses[0].dim() == 0
        self._log("backward_begin")

    def backward_end(self, watcher):
        self._log("backward_end")

    def optimizer_begin(self, watcher):
        self._log("optimizer_begin")

    def optimizer_end(self, watcher):
        self._log("optimizer_end")

    def detection(self, watcher, det, opt):
        self._log(f"detection {det.step} {det.phase}")

    def event(self, watcher, det):
        self._log(f"event {det.step}")


def _train(w, batches):
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.stack(batches)), batch_size=None)
    with w:  # as under nanguard run: the script builds its model and optimizer under the hooks
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for (x,) in loader:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def test_the_observer_hears_each_step_in_order_and_the_failure():
    log = Log()
    batches = [torch.randn(4, 3) for _ in range(2)]
    batches[1][0, 0] = float("nan")
    w = Watcher(nanguard.GuardConfig(on_nonfinite="warn"), tape=True, observer=log)
    _train(w, batches)
    step = ["data_begin", "data_end", "backward_begin", "backward_end", "optimizer_begin"]
    assert log.calls[:7] == ["step_start 0"] + step + ["optimizer_end"]
    assert log.calls[7] == "step_start 1"
    assert log.calls[8:13] == step
    assert log.calls[13:15] == ["detection 1 data", "event 1"]   # at the check, before the update
    assert log.calls[15:17] == ["optimizer_end", "step_start 2"]


def test_several_observers_are_called_in_order_and_none_is_a_no_op():
    calls: list = []
    both = combine(None, Log("a:", calls), Log("b:", calls))
    assert isinstance(both, Observers)
    w = Watcher(nanguard.GuardConfig(), observer=[Log("a:", calls), Log("b:", calls)])
    w.install()
    w.uninstall()
    assert calls == ["a:step_start 0", "b:step_start 0"]
    assert type(combine()) is WatchObserver and combine(None).recorder is None


def test_a_healthy_run_trains_the_same_with_an_observer():
    batches = [torch.randn(4, 3) for _ in range(3)]
    plain = _train(Watcher(nanguard.GuardConfig()), batches)
    seen = _train(Watcher(nanguard.GuardConfig(), tape=True, observer=Log(), on_spike="warn", quiet=True), batches)
    assert torch.equal(plain.weight, seen.weight) and torch.equal(plain.bias, seen.bias)


def test_the_watcher_attaches_its_policy_and_the_policy_holds_it_weakly():
    policy = RecoveryPolicy()
    w = Watcher(nanguard.GuardConfig(), policy=policy)
    assert w.policy is policy and policy._watcher() is w
    assert Watcher(nanguard.GuardConfig()).policy is None


def test_the_rerun_is_told_the_bundle_until_one_was_written(tmp_path):
    asked = []

    def rerun(det, bundle):
        asked.append(bundle)
        return {"method": "rerun", "reproduced": False, "reason": "test"}

    w = Watcher(nanguard.GuardConfig(), localize=LocalizeSpec(rerun=rerun, bundle=str(tmp_path / "b.pt")))
    det = Detection(step=3, phase="forward", detected={})
    out = w.localizer.fallback(det, {"method": "replay-tape", "reason": "no tape"})
    assert out["fallback_from"] == {"method": "replay-tape", "reason": "no tape"}
    w.localizer.bundle_written = True
    w.localizer.fallback(det, None)
    assert asked == [str(tmp_path / "b.pt"), None]
    assert Watcher(nanguard.GuardConfig()).localizer is None
