"""``OpRecorder``: ties the parts together for one armed training step and builds the result.

Per ATen op (``_before`` / ``_after``, called by the dispatch mode): the inputs' finiteness and taints
(provenance), the op record (op log: name, stage, module, API, user line), the outputs' taints, and
for a new origin its description and evidence facts.
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Callable, Sequence

import torch

from ...core.diagnosis.roles import INDEX, OVERWRITE, SELECT, UNINITIALISED
from ...core.locate.result import constant_detail, failed_result
from ...core.locate.taint import absorbed
from .. import numerics as N
from . import library as _library  # noqa: F401  (registers the library-call evidence gatherers)
from .evidence import Evidence
from .modes import Modes, Switch
from .naming import Frames, ModuleTracker, Names
from .oplog import OpLog
from .ops import Mutations, flatten, is_inplace, opname
from .provenance import Origin, Provenance, Sinks
from .result import build_result

__all__ = ["OpRecorder"]

# torch.distributed collectives (FSDP2's all-gather/reduce-scatter, functional collectives): a
# non-finite output from finite local inputs came from another rank; they are never re-run (a re-run
# on one rank is a collective the other ranks never join).
aten = torch.ops.aten
_KEEP_INPLACE = 1 << 22  # elements: an in-place op's input kept for its description (transient, per op)
_COLLECTIVES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


class OpRecorder:
    """Record every ATen op of one training step and find where a non-finite value is born.

    Call order for one step (``start``/``stop`` may run in different hooks, same thread)::

        rec.start()                      # before the step's forward (or before the script for step 0)
        loss = model(batch) ...
        rec.mark_loss(loss)              # each tensor .backward() is called on
        rec.set_stage("backward"); loss.backward()
        rec.set_stage("optimizer"); opt.step()   # evaluates the gradient sink first
        rec.stop()                       # evaluates the parameter/state sink, removes modes and hooks
        loc = rec.result()

    Ops inside the autograd engine are "backward" whatever the stage says; other ops are "forward"
    until ``set_stage("optimizer")``. ``with rec.paused(): ...`` runs the caller's own checks unrecorded.
    """

    def __init__(self, *, named_params: dict[str, torch.Tensor], named_buffers: dict[str, torch.Tensor],
                 roots: Sequence[torch.nn.Module] = (), optimizers: Sequence[torch.optim.Optimizer] = (),
                 user_file_filter: Callable[[str], bool] | None = None, max_records: int = 200_000,
                 anomaly_tracebacks: bool = False, data_rows: Callable[[torch.Tensor], Any] | None = None):
        """``anomaly_tracebacks``: also turn on autograd anomaly mode (check_nan=False) so every node keeps
        ``metadata["traceback_"]``. Off by default: every node is already tagged with the forward op that
        created it (op, module, user frame), and the traceback capture costs ~0.1-0.3 ms per node.
        ``data_rows(t)``: the dataset indices of the rows of a batch tensor ``t`` (or None), from the
        DataLoader hooks (:mod:`nanguard.pytorch.data`): a batch holding non-finite values is then
        reported by its batch rows and dataset rows."""
        self.data_rows = data_rows
        self.anomaly_tracebacks = bool(anomaly_tracebacks)
        # the caller's dicts are kept by reference (they may be filled after start()) and never mutated
        self.named_params = named_params if isinstance(named_params, dict) else dict(named_params or {})
        self.named_buffers = named_buffers if isinstance(named_buffers, dict) else dict(named_buffers or {})
        self.roots = list(roots)
        # kept by reference when a list: a caller may register optimizers created after start()
        self.optimizers = optimizers if isinstance(optimizers, list) else list(optimizers)
        self.user_file_filter = user_file_filter
        self.max_records = int(max_records)
        self._frames = Frames(user_file_filter)
        self._reset()

    def _reset(self) -> None:
        self._switch = Switch()
        self._started = False
        self._stopped = False
        self._stage = "forward"
        self._notes: list[str] = []
        self._errors = 0
        self._result: dict | None = None
        self._n_ops = 0
        self._thread: int | None = None
        self._pending: list[tuple[Any, int]] = []     # recent forward outputs whose grad_fn is not tagged yet
        self._param_versions: dict[int, int | None] = {}
        self._mutated = Mutations()
        self._names = Names(self.named_params, self.named_buffers, self.optimizers, self._notes)
        self._modules = ModuleTracker(self._names, self._switch)
        self._modes = Modes(self._switch, self._notes)
        self._log = OpLog(self.max_records)
        self._prov = Provenance(self._names, self._notes, self._now)
        self._sinks = Sinks(self._prov, self._names)
        self._evidence = Evidence(self._log, self._prov, self._frames, self._modes.api_stack, self._mutated)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "OpRecorder":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Arm: dispatch + function modes, global module hooks (and anomaly metadata if asked for)."""
        if self._started:
            return
        self._started = True
        self._thread = threading.get_ident()
        self._names.index_known()
        self._param_versions = {pid: N.version(p) for pid, p in self._names.params.items()}
        for root in self.roots:
            self._modules.register_tree(root)
        if self.anomaly_tracebacks:
            self._modes.enable_anomaly_metadata()
        try:
            self._modules.install(self._thread)
            self._modes.install(self._before, self._after, self._fail)
        except Exception:
            self.stop()
            raise
        self._switch.armed = True

    def stop(self) -> None:
        """Disarm (idempotent) and evaluate the sinks; never leaves modes or hooks installed."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        self._switch.armed = False
        try:
            self._switch.busy = True
            try:
                self._resolve_pending()
                if self._sinks.grad is None:
                    self._sinks.eval_grad()
                self._names.sync_given()
                updated = any(N.version(p) != self._param_versions.get(pid, N.version(p))
                              for pid, p in self._names.params.items())
                if self._stage == "optimizer" or self._log.opt_ops or updated:
                    self._sinks.eval_opt()
            except Exception as e:
                self._fail(e)
            finally:
                self._switch.busy = False
        finally:
            self._teardown()

    def _teardown(self) -> None:
        self._modes.remove()
        self._modules.remove()
        self._modes.restore_anomaly()
        self._modes.api_stack.clear()
        self._log.clear_ring()

    def set_call_site(self, boundary: Any, site: tuple | None) -> None:
        """In-process replay: ``boundary`` is the code object of the replay's call trampoline, ``site``
        the (user frame, library frame) recorded when the call first ran; frame walks that reach the
        boundary before a user frame answer with ``site`` (the stack above it is nanguard's)."""
        self._frames.boundary, self._frames.site = boundary, site

    @property
    def busy(self) -> bool:
        """The recorder is running its own code (its checks read values with ``Tensor.item``), or is
        paused: torch calls made now are not the recorded step's."""
        return self._switch.busy

    def paused(self):
        """Context manager: run your own torch code while armed without it being recorded."""
        return self._modes.paused()

    def set_stage(self, stage: str) -> None:
        """'forward' | 'backward' | 'optimizer' (set by the caller around backward() and step())."""
        if stage not in ("forward", "backward", "optimizer"):
            raise ValueError(f"unknown stage {stage!r}")
        prev_busy, self._switch.busy = self._switch.busy, True
        try:
            self._resolve_pending()
            self._names.sync_given()
            if stage == "optimizer" and self._stage != "optimizer":
                self._sinks.eval_grad()
                self._names.index_optimizer_state()
            self._stage = stage
        except Exception as e:
            self._fail(e)
        finally:
            self._switch.busy = prev_busy

    def mark_loss(self, loss: torch.Tensor) -> None:
        """The tensor .backward() is called on (forward sink); may be called several times."""
        prev_busy, self._switch.busy = self._switch.busy, True
        try:
            with torch._C.DisableTorchFunction(), torch.no_grad():
                self._resolve_pending()
                self._sinks.add_loss(loss)
        except Exception as e:
            self._fail(e)
        finally:
            self._switch.busy = prev_busy

    def result(self) -> dict:
        """The localisation (JSON-serialisable). Call after stop()."""
        if self._result is not None:
            return self._result
        prev_busy, self._switch.busy = self._switch.busy, True
        try:
            with torch._C.DisableTorchFunction(), torch.no_grad():
                self._names.sync_given()
                res = build_result(self._notes, self._n_ops, self._sinks, self._prov, self._names, self._log,
                                   self._evidence, self.data_rows, self._modules.batch_size,
                                   [r() for r in self._modules.batch_inputs])
        except Exception as e:
            res = failed_result(self._n_ops, self._notes, e)
        finally:
            self._switch.busy = prev_busy
        if self._stopped:
            self._result = res
        return res

    # ------------------------------------------------------------------ per-op core
    def _fail(self, e: BaseException) -> None:
        self._errors += 1
        if self._errors <= 5:
            self._notes.append(f"recorder error (ignored): {type(e).__name__}: {str(e)[:200]}")

    def _cur_stage(self) -> str:
        """'backward' inside the autograd engine; 'optimizer' after set_stage('optimizer'); else 'forward'
        (ops between backward() and step(), or the next micro-batch's forward, run outside the engine)."""
        try:
            if torch._C._current_autograd_node() is not None:
                return "backward"
        except Exception:
            pass
        return "optimizer" if self._stage == "optimizer" else "forward"

    def _now(self) -> tuple[int, str]:
        return self._n_ops, self._cur_stage()

    def _resolve_pending(self) -> None:
        """Tag the autograd node of each recent forward output with the op that created it."""
        if not self._pending:
            return
        pend, self._pending = self._pending, []
        with torch._C.DisableTorchFunction():
            for ref, idx in pend:
                t = ref()
                if t is None:
                    continue
                try:
                    gf = t.grad_fn
                    if gf is not None:
                        md = gf.metadata
                        if "nanguard_fwd" not in md:
                            md["nanguard_fwd"] = idx
                except Exception:
                    pass

    def _before(self, func, args, kwargs):
        """Inputs read by the op: (key, list position, tensor, nan, inf, taint, producer, carried origin)."""
        self._resolve_pending()
        stage = self._cur_stage()
        tens, scal = flatten(args, kwargs)
        over = opname(func) in OVERWRITE.ops
        prov = self._prov
        ins = []
        for key, pos, t in tens:
            if key == "out" or (over and key == 0):
                continue    # written, not read: its old values do not matter
            nan, inf, taint, info = prov.lookup(t)
            if taint is not None and taint.real and stage != "optimizer" and not (
                    taint.kind == "preexisting" and taint.pre_kind in ("param", "buffer")):
                taint = prov.param_written(t, taint, info) or taint
            ins.append((key, pos, t, nan, inf, taint, info.prod if info is not None else None,
                        info.carried if info is not None else None))
        keep = None
        if stage != "optimizer" and args and is_inplace(func) and ins and ins[0][0] == 0 and not (ins[0][3] or ins[0][4]):
            t0 = ins[0][2]
            if t0.dtype.is_floating_point and t0.layout == torch.strided and t0.numel() <= _KEEP_INPLACE:
                # the value it is about to overwrite: should this op be an origin, its inputs and its re-runs in
                # float64/float32 read what it read (index_add_ onto zeros), not what it wrote (inf)
                keep = aten.clone.default(t0.detach())
        return stage, ins, scal, keep

    def _outputs(self, func, args, kwargs, out, foreach: bool) -> tuple[list, set]:
        """Returned tensors plus the arguments the op writes (in-place / out=), and the ids of the latter."""
        outs: list[tuple[int | None, torch.Tensor]] = []
        seen: set[int] = set()
        mut_ids: set[int] = set()

        def add(t: Any, pos: int | None) -> None:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                outs.append((pos if foreach else None, t))
        if isinstance(out, torch.Tensor):
            add(out, None)
        elif isinstance(out, (list, tuple)):
            for j, o in enumerate(out):
                if isinstance(o, (list, tuple)):
                    for jj, oo in enumerate(o):
                        add(oo, jj)
                else:
                    add(o, j)
        for _key, m in self._mutated(func, args, kwargs):
            if isinstance(m, torch.Tensor):
                mut_ids.add(id(m))
                add(m, None)
            elif isinstance(m, (list, tuple)):
                for j, mm in enumerate(m):
                    if isinstance(mm, torch.Tensor):
                        mut_ids.add(id(mm))
                        add(mm, j)
        return outs, mut_ids

    def _after(self, func, args, kwargs, out, pre) -> None:
        stage, ins, scal, keep = pre
        idx = self._n_ops
        self._n_ops += 1
        name = opname(func)
        foreach = name.startswith("_foreach_")
        log = self._log
        record = idx < log.max_records
        if idx == log.max_records:
            self._notes.append(f"more than {log.max_records} ops: later ops are tracked but not recorded")
        outs, mut_ids = self._outputs(func, args, kwargs, out, foreach)
        remote = getattr(func, "namespace", None) in _COLLECTIVES
        module = self._modules.current
        api = self._modes.api_stack[-1][0] if self._modes.api_stack else None
        low = False
        any_nf = False
        results = []
        garbage = name in UNINITIALISED.ops
        for pos, t in outs:
            if not N.is_checkable(t):
                continue
            if t.dtype in N.LOW_PRECISION:
                low = True
            nan, inf = (False, False) if garbage else N.nonfinite_flags(t)
            results.append((pos, t, nan, inf))
            any_nf = any_nf or nan or inf

        if record:
            site = self._frames.site_now() if stage == "forward" else (None, None)
            log.append(func, name, stage, module, api, scal, any_nf, ins, site[0], site[1],
                       self._modules.current_type if module == "" else None)
            if site[0] is not None and site[0][2] == "forward":  # maybe in a torch.autograd.Function's forward
                at = self._frames.applied_at(sys._getframe(1))
                if at is not None:
                    log.applied_at[idx] = at
            if low and not remote:
                log.hold_low_precision(idx, func, args, kwargs, ins)
            if stage == "forward" and not remote:
                log.hold_forward(idx, name, func, args, kwargs, ins)
            if stage == "optimizer":
                if not log.opt_ops:
                    self._names.discover_optimizer()
                log.opt_ops.append((idx, [(i[0], i[1], id(i[2])) for i in ins], [(p, id(t)) for p, t in outs]))

        # consumers of non-finite forward tensors and of domain-sensitive ops' outputs (where-trap evidence)
        if stage == "forward":
            log.add_consumers(idx, name, ins, any_nf, bool(results))

        prov = self._prov
        carries = stage != "optimizer" and name not in SELECT.ops and name not in INDEX.ops and not foreach
        new_origin: Origin | None = None
        new_const: Origin | None = None
        for pos, t, nan, inf in results:
            taint = None
            if nan or inf:
                rel = [i for i in ins if not foreach or i[1] is None or i[1] == pos]
                rel_s = [s for s in scal if not foreach or s[1] is None or s[1] == pos]
                taint = prov.decide(nan, inf, rel, rel_s, name, t)
                if taint == "new" and remote:  # received from another rank
                    taint = new_const = new_const or prov.new_origin("remote", idx, stage)
                elif taint == "new" and name == "set" and not any(isinstance(a, torch.Tensor) for a in args[1:2]):
                    taint = prov.arrived(t, nan, inf)  # rebuilt from a storage (another process): data
                if taint == "new":
                    if new_origin is None:
                        new_origin = prov.new_origin("op", idx, stage)
                    taint = new_origin
                elif taint == "const":
                    if new_const is None:
                        new_const = prov.new_origin("constant", idx, stage)
                    taint = new_const
                elif taint.kind == "preexisting" and taint.first_use is None:
                    taint.first_use = self._evidence.first_use(func, name, args, t, stage, self._modules.current)
            prov.set_info(t, nan, inf, taint, (idx, pos), mutated=id(t) in mut_ids)
            if not (nan or inf) and ins and carries:  # a finite value made from an earlier failure's values
                prov.carry(t, absorbed([i[5] for i in ins if i[3] or i[4]], [i[7] for i in ins]))
            if stage == "forward" and record:
                self._pending.append((weakref.ref(t), idx))
            elif stage == "backward" and record:
                # a backward with create_graph (a gradient penalty, double backprop): the node this output gets
                # (autograd sets it after the op returns) belongs to the forward op whose backward is running: a
                # failure in the second backward names that op
                fi = _running_forward()
                if fi is not None:
                    self._pending.append((weakref.ref(t), fi))
        if new_origin is not None:
            if keep is not None:  # an in-place op: described on the value it read
                args = (keep,) + tuple(args[1:])
                ins = [(i[0], i[1], keep) + tuple(i[3:]) if i[0] == 0 else i for i in ins]
            self._evidence.describe(new_origin, func, name, args, kwargs, ins, scal, results, stage, module, api,
                                    self._modules.current_type)
        if new_const is not None and new_const.kind == "remote":
            new_const.detail = {"op": str(func), "name": name, "module": module, "stage": stage,
                                "collective": True, "note": "received non-finite from another rank"}
        elif new_const is not None:
            new_const.detail = constant_detail(str(func), name, api, module, stage, self._frames.user_frame(),
                                               [N.jnum(v) for _k, _p, v in scal][:6])


def _running_forward() -> int | None:
    """The forward op (its log index) of the autograd node the engine is running, when the recorder tagged it."""
    try:
        node = torch._C._current_autograd_node()
        return node.metadata.get("nanguard_fwd") if node is not None else None
    except Exception:
        return None
