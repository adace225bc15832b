"""Data-parallel training on 2 ranks (gloo, CPU) with three failures, for tests/torch/test_fsdp.py.

``torchrun --nproc_per_node 2 train_parallel.py OUT WRAP MODE``: WRAP ``fsdp`` (FSDP2
``fully_shard``, DTensor parameters and gradients) or ``ddp`` (DistributedDataParallel, two
micro-batches per step, the first under ``no_sync()``); MODE ``recover`` (Guard with
``recover="auto"``, synchronous then sync-free, plus an unguarded reference and a healthy
bit-for-bit comparison), ``stop`` (Guard stopping at the first failure) or ``plain`` (the
unguarded loop, for ``nanguard run``). The failures, by construction:

* step 2, rank 1: a NaN feature in the batch (bad input data; not in ``stop`` mode);
* step 5, rank 0: a negative count feature, so the model's ``torch.log`` of it is NaN
  in the forward pass (a log-domain error; the input itself is finite);
* step 9: the learning rate is raised 1500x: the loss diverges and overflows a few
  steps later (the step is found by the unguarded reference with the same skips).

Each rank writes ``rank{r}.json`` (what it saw) and its final parameters to OUT.
"""
import json, math, os, sys
import torch, torch.distributed as dist, torch.nn as nn

dist.init_process_group("gloo")
rank = dist.get_rank()
OUT, WRAP, MODE = sys.argv[1], sys.argv[2], sys.argv[3]
DATA_BAD = (1, 2) if MODE != "stop" else None   # (rank, step): a NaN feature in the batch
LOG_BAD = (0, 5)      # (rank, step): a negative count -> log of a negative number in the forward
LR_STEP, LR_HIGH = 9, 30.0   # the learning rate is raised once: the loss diverges
STEPS = 22
MICRO = 2 if WRAP == "ddp" else 1   # DDP: two micro-batches per step, the first under no_sync()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 1)
        self.skip = nn.Linear(4, 1)

    def forward(self, x):
        feats = torch.cat([x[:, :3], torch.log(x[:, 3:4])], 1)  # log of a count feature
        return self.fc2(torch.tanh(self.fc1(feats))) + self.skip(feats)


def build(fused=False):
    torch.manual_seed(0)
    net = Net()
    if WRAP == "fsdp":
        from torch.distributed.fsdp import fully_shard
        fully_shard(net.fc1)
        fully_shard(net)
        model = net
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(net)
    return net, model, torch.optim.SGD(model.parameters(), lr=0.02)


def batches(step, faults=True):
    g = torch.Generator().manual_seed(1000 * rank + step)
    out = []
    for _ in range(MICRO):
        x = torch.cat([torch.randn(8, 3, generator=g), torch.rand(8, 1, generator=g) * 4 + 0.5], 1)
        y = 1.5 * x[:, :1] - torch.log(x[:, 3:4]) + 0.1 * torch.randn(8, 1, generator=g)
        out.append((x, y))
    if faults and (rank, step) == DATA_BAD:
        out[0][0][5, 2] = float("nan")
    if faults and (rank, step) == LOG_BAD:
        out[-1][0][3, 3] = -1.0
    return out


def loss_fn(model):
    return lambda b: ((model(b[0]) - b[1]) ** 2).mean() / MICRO


def plain_step(model, opt, bs, apply=True):
    opt.zero_grad()
    for i, b in enumerate(bs):
        ctx = model.no_sync() if (WRAP == "ddp" and i < len(bs) - 1) else _null()
        with ctx:
            loss = loss_fn(model)(b)
            loss.backward()
    if apply:
        opt.step()
    return loss


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def params(net):
    return [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in net.parameters()]


def reference():
    """Unguarded, with the guard's expected skips applied by hand: the first non-finite step of the divergence."""
    net, model, opt = build()
    for step in range(STEPS):
        if step == LR_STEP:
            for g in opt.param_groups:
                g["lr"] = LR_HIGH
        skip = (DATA_BAD is not None and step == DATA_BAD[1]) or step == LOG_BAD[1]
        loss = plain_step(model, opt, batches(step), apply=not skip)
        if skip:
            continue
        ok = torch.tensor([float(math.isfinite(loss.item()) and all(bool(torch.isfinite(p).all()) for p in params(net)))])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() < 1:
            return step
    return None


def healthy(sync_free):
    """Guarded and unguarded training on fault-free batches: bit for bit the same."""
    import nanguard
    n0, m0, o0 = build()
    n1, m1, o1 = build()
    g = nanguard.Guard(m1, o1, quiet=True, bundle=None, sync_free=sync_free, sync_free_every=3)
    for step in range(10, 16):
        plain_step(m0, o0, batches(step, faults=False))
        bs = batches(step, faults=False)
        g.step(bs if MICRO > 1 else bs[0], loss_fn(m1), micro_batches=MICRO > 1)
    g.close()
    return all(torch.equal(a, b) for a, b in zip(params(n0), params(n1))) and g.report.status == "clean"


def guarded(sync_free, on_nonfinite="stop", recover=None):
    import nanguard
    net, model, opt = build()
    kw = dict(recover=recover) if recover else dict(on_nonfinite=on_nonfinite)
    g = nanguard.Guard(model, opt, report=os.path.join(OUT, f"report_sf{int(sync_free)}.json"), bundle=None,
                       sync_free=sync_free, sync_free_every=3, **kw)
    error = None
    before = None
    try:
        for step in range(STEPS):
            if step == LR_STEP:
                for grp in opt.param_groups:
                    grp["lr"] = LR_HIGH
            if step == LOG_BAD[1]:
                before = params(net)
            bs = batches(step)
            g.step(bs if MICRO > 1 else bs[0], loss_fn(model), micro_batches=MICRO > 1)
    except nanguard.NonFiniteError as e:
        error = {"step": e.event.step, "rank": e.event.rank, "category": e.event.cause["category"]}
    rep = g.close() if error is None else g.report
    evs = [{"step": e.step, "phase": e.phase, "rank": e.rank, "category": (e.cause or {}).get("category"),
            "action": (e.recovery or {}).get("action"), "origin_op": (e.origin or {}).get("op"),
            "reproduced": (e.localization or {}).get("reproduced"),
            "read_late": (e.detected or {}).get("sync_free")} for e in rep.events]
    state = params(net)
    out = {"error": error, "events": evs, "status": rep.status, "finite": all(bool(torch.isfinite(p).all()) for p in state),
           "pre_step_kept": None if before is None or error is None else all(torch.equal(a, b) for a, b in zip(before, state))}
    torch.save([p.clone() for p in state], os.path.join(OUT, f"state{rank}_sf{int(sync_free)}.pt"))
    return out


res = {}
if MODE == "plain":   # the unguarded script, for nanguard run
    net, model, opt = build()
    for step in range(STEPS):
        if step == LR_STEP:
            for grp in opt.param_groups:
                grp["lr"] = LR_HIGH
        plain_step(model, opt, batches(step))
    res["finite"] = all(bool(torch.isfinite(p).all()) for p in params(net))
    torch.save(params(net), os.path.join(OUT, f"state{rank}_plain.pt"))
else:
    res["reference_divergence_step"] = reference() if MODE == "recover" else None
    res["healthy_bit_for_bit"] = {str(sf): healthy(sf) for sf in (False, True)} if MODE == "recover" else None
    for sf in (False, True):
        res[f"sf{int(sf)}"] = guarded(sf, recover="auto" if MODE == "recover" else None)
with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
    json.dump(res, f)
dist.destroy_process_group()
