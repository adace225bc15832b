"""Hugging Face Trainer: ``nanguard.integrations.hf.NanGuardCallback`` with a tiny GPT-2 built from a
config (no download), on CPU, ``report_to=[]``."""
from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from nanguard.integrations.hf import NanGuardCallback  # noqa: E402

from ngtest import load_report  # noqa: E402

BS, STEPS, K = 4, 6, 3
pytestmark = pytest.mark.skipif(not hasattr(transformers.TrainerCallback, "on_pre_optimizer_step"),
                                reason="transformers too old (no on_pre_optimizer_step)")


class Embeds(torch.utils.data.Dataset):
    """Sequences given as ``inputs_embeds`` (float, so a NaN can sit in the data), with LM labels."""

    def __init__(self, nan_at=None):
        g = torch.Generator().manual_seed(0)
        self.emb = torch.randn(BS * STEPS, 8, 16, generator=g) * 0.1
        self.labels = torch.randint(0, 50, (BS * STEPS, 8), generator=g)
        if nan_at is not None:
            step, row = nan_at
            self.emb[step * BS + row, 2, 5] = float("nan")

    def __len__(self):
        return len(self.emb)

    def __getitem__(self, i):
        return {"inputs_embeds": self.emb[i], "labels": self.labels[i]}


class SequentialTrainer(Trainer):
    """Batches in dataset order (transformers < 5 has no train_sampling_strategy="sequential")."""

    def _get_train_sampler(self, *a, **k):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def make_trainer(tmp_path, ds, callbacks=(), **kw):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16))
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=BS, max_steps=STEPS,
                             learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, report_to=[],
                             logging_steps=1, save_strategy="no", use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0, seed=0)
    return SequentialTrainer(model=model, args=args, train_dataset=ds, callbacks=list(callbacks), **kw)


def _lrs(trainer):
    return [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_recover_drops_the_bad_sample_keeps_the_schedule_and_finishes(tmp_path):
    cb = NanGuardCallback(recover="auto", report=str(tmp_path / "r.json"), quiet=True)
    tr = make_trainer(tmp_path, Embeds(nan_at=(K, 1)), [cb])
    tr.train()
    assert tr.state.global_step == STEPS  # training finished
    rep = load_report(tmp_path / "r.json")
    assert rep["status"] == "recovered"
    assert len(rep["events"]) == 1
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (K, "data")
    assert ev["cause"]["category"] == "bad_input_data"
    # the replay without row 1 was finite: step K trains on the other rows (verified before applying)
    assert ev["recovery"]["action"] == "drop_samples" and ev["recovery"]["actions"]["drop_samples"]["rows"] == [1]
    assert ev["localization"]["reproduced"] is True  # the model forward + loss was replayed
    assert ev["origin"]["samples"] == [1]
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())
    steps = {int(st["step"]) for st in tr.optimizer.optimizer.state.values()}
    assert steps == {STEPS}
    # not hidden: the report keeps the real NaN loss of step K, while the Trainer's
    # logging_nan_inf_filter (on by default) replaced it in its own logs
    assert tr.args.logging_nan_inf_filter
    assert rep["history"][K]["loss"] == "nan" and rep["history"][K]["skipped"] is False
    logged = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert len(logged) == STEPS and all(math.isfinite(v) for v in logged)
    # the LR scheduler still stepped at the skipped step: the same schedule as a clean run
    clean = make_trainer(tmp_path, Embeds())
    clean.train()
    assert _lrs(tr) == _lrs(clean)
    assert tr.lr_scheduler.get_last_lr() == clean.lr_scheduler.get_last_lr()


@pytest.mark.slow  # over ~9 s on 2 cores: the quick pass stays under 10 minutes
def test_stop_on_log_of_zero_in_the_trainers_loss(tmp_path):
    holder = {}

    def loss_func(outputs, labels, num_items_in_batch=None):  # the Trainer's compute_loss_func
        logits = outputs.logits[:, :-1]
        probs = torch.softmax(logits, -1)
        if holder["trainer"].state.global_step == K:
            probs = probs * 0.0  # the bug: every probability underflows to 0
        logp = torch.log(probs)
        return torch.nn.functional.nll_loss(logp.reshape(-1, logp.shape[-1]), labels[:, 1:].reshape(-1))

    cb = NanGuardCallback(on_nonfinite="stop", report=str(tmp_path / "r.json"), quiet=True)
    tr = make_trainer(tmp_path, Embeds(), compute_loss_func=loss_func)
    holder["trainer"] = tr
    cb.attach(tr)
    tr.train()
    assert tr.state.global_step == K + 1  # stopped after the failing step
    assert cb.stopped is not None and cb.stopped.step == K
    rep = load_report(tmp_path / "r.json")
    assert rep["status"] == "nonfinite"
    ev = rep["events"][0]
    assert (ev["step"], ev["phase"]) == (K, "forward")
    assert ev["cause"]["category"] == "log_domain"
    assert ev["origin"]["op"] == "aten.log.default"
    assert ev["origin"]["function"] == "loss_func"
    assert rep["steps_watched"] == K
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())  # the bad update was dropped
