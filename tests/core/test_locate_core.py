"""The locate logic both backends share (``nanguard.core.locate``), on plain records: no framework."""
from __future__ import annotations

import json
import os

import pytest

from nanguard.core.locate import (CONST, NEW, Gatherers, Localization, LocalizationPort, OpGraph, OptimizerInfo,
                                  OriginShape, Preexisting, ProbeBase, Sink, Sinks, Taints, UserFiles,
                                  build_localization, choose_sink, escaped_mask, failed_result, origin_dict,
                                  source_rows)
from nanguard.core.locate import naming as CN
from nanguard.core.locate import oplog as CO


def _never() -> bool:
    raise AssertionError("the mask test must not run when no soft taint reaches the op")


# ---------------------------------------------------------------------------- taints
def test_decide_real_beats_soft_and_earliest_wins():
    t = Taints()
    soft = t.add("constant", True, 0, "forward")
    a = t.add("op", False, 1, "forward")
    b = t.add("op", False, 2, "forward")
    assert t.decide(True, False, [soft, b, None, a], True, False, _never, ()) is a


def test_decide_new_origins_from_clean_inputs():
    t = Taints()
    assert t.decide(True, False, [None], False, True, _never, ()) == NEW        # NaN out of NaN-free (inf-only) inputs
    assert t.decide(False, True, [None], False, False, _never, ()) == NEW       # overflow from finite inputs
    assert t.decide(True, False, [None], True, False, _never, ()) == CONST      # NaN in, NaN out, no taint: unexplained
    assert t.decide(True, False, [None], True, False, _never, (), unexplained=NEW) == NEW


def test_decide_inherits_soft_unless_a_reduction_keeps_a_mask():
    t = Taints()
    mask = t.add("constant", True, 0, "forward")
    mask.detail = {"name": "masked_fill", "api": "Tensor.masked_fill", "file": "u.py", "line": 3, "scalars": ["-inf"]}
    other = t.add("constant", True, 1, "forward")
    other.detail = {"name": "mul"}
    # a softmax-like op (not a mask sink) inherits the mask: not an origin
    assert t.decide(False, True, [mask], False, True, lambda: False, {"masked_fill"}) is mask
    assert t.escaped_mask is None
    # a sum over the masked entries: the reduction is the origin, and it remembers the mask it kept
    assert t.decide(False, True, [mask], False, True, lambda: True, {"masked_fill"}) == NEW
    assert t.take_escaped_mask() is mask and t.escaped_mask is None
    # not every soft taint is a mask written by a mask writer: inherit the earliest soft one
    assert t.decide(False, True, [other, mask], False, True, lambda: True, {"masked_fill"}) is mask
    pre = t.add("preexisting", True, 2, "forward")   # a -inf-only input (soft pre-existing)
    assert escaped_mask([mask, pre], {"masked_fill"}) is None
    assert escaped_mask([], {"masked_fill"}) is None


def test_earliest_and_fallback():
    t = Taints()
    s = t.add("constant", True, 0, "forward")
    f = t.add("op", False, 1, "forward")
    b = t.add("op", False, 5, "backward")
    r = t.add("remote", False, 6, "backward")
    assert Taints.earliest([None, b, s, f]) is f
    assert Taints.earliest([s, None]) is s
    assert Taints.earliest([None]) is None
    assert t.fallback("backward") is b           # the stage's earliest real op/pre-existing origin
    assert t.fallback("optimizer") is f          # else the earliest real one
    assert r.real and t.fallback("backward") is not r


# ---------------------------------------------------------------------------- the op log
def _graph() -> OpGraph:
    g = OpGraph(100, pass_ops={"view"}, select_ops={"where"}, keep_ops={"log"})
    g.record("x", [])                          # 0
    g.record("log", [(0, None)])               # 1
    g.record("view", [(1, None)])              # 2 (pass-through)
    g.record("mul", [(2, None), (0, None)])    # 3
    g.record("add", [None, (3, None)])         # 4
    return g


def test_record_and_producer_chain():
    g = _graph()
    assert len(g) == 5 and g.inprod[4] == (-1, 3)
    assert g.chain(4, depth=3) == [4, 3, 2, 1]        # the view does not count towards the depth
    assert g.chain(4, depth=1) == [4]
    assert g.chain(None) == [] and g.chain(99) == []


def test_where_trap_walk():
    g = _graph()
    g.note_consumers(5, "where", [((1, None), False)], False, True)     # the output of log (a kept op) selected
    assert g.consumers[1] == [(5, "where", False, True)]
    assert g.where_trap(1)                       # only selected: the gradient of the masked entries is the trap
    g.note_consumers(6, "view", [((1, None), False)], False, True)
    g.note_consumers(7, "where", [((6, None), True)], False, True)       # through a view into a selection
    assert g.where_trap(1)
    g.note_consumers(8, "where", [((6, None), True)], True, True)        # a selection that kept the bad entries
    assert not g.where_trap(1)
    g2 = _graph()
    g2.note_consumers(5, "mul", [((1, None), False)], False, True)       # used by arithmetic
    assert not g2.where_trap(1)
    assert not _graph().where_trap(1)            # no selection seen
    assert not g2.where_trap(50)                 # not recorded
    # tf.image.adjust_gamma: gain * x ** gamma carries the pow's NaN on, then tf.where drops it (a GAN's augment)
    g4 = _graph()
    g4.note_consumers(5, "mul", [((1, None), False)], True, True)        # arithmetic, its result non-finite too
    g4.note_consumers(6, "where", [((5, None), True)], False, True)
    assert g4.where_trap(1)
    g5 = _graph()
    g5.note_consumers(5, "mul", [((1, None), False)], True, True)
    g5.note_consumers(6, "add", [((5, None), True)], False, True)        # ... but a later op made it finite: a use
    assert not g5.where_trap(1)
    g3 = _graph()
    g3.note_consumers(5, "mul", [((3, None), False)], False, True)       # finite value of a non-kept op: not noted
    g3.note_consumers(5, "mul", [(None, True)], False, True)
    assert g3.consumers == {}


def test_held_arguments_budgets(monkeypatch):
    monkeypatch.setattr(CO, "RING_SIZE", 2)
    monkeypatch.setattr(CO, "RING_BUDGET", 10)
    monkeypatch.setattr(CO, "KEEP_FORWARD_BUDGET", 10)
    g = OpGraph(10, keep_ops={"log"})
    g.hold_ring(0, ("a", 4))
    g.hold_ring(1, ("b", 4))
    g.hold_ring(2, ("c", 4))                     # over the size: the oldest goes
    assert list(g.ring) == [1, 2]
    g.hold_ring(3, ("d", 8))                     # over the element budget: oldest first until it fits
    assert list(g.ring) == [3]
    g.hold_ring(4, ("e", 11))                    # larger than the whole budget: never held
    assert list(g.ring) == [3]
    g.clear_ring()
    assert not g.ring and g._ring_elems == 0
    assert g.wants_keep("log") and not g.wants_keep("exp")
    g.hold_keep(0, ("k0",), 6)
    g.hold_keep(1, ("k1",), 6)                   # would exceed the budget
    assert list(g.keep) == [0] and g.wants_keep("log")
    g.hold_keep(2, ("k2",), 4)
    assert not g.wants_keep("log")               # budget spent


# ---------------------------------------------------------------------------- the sink and the result
def test_choose_sink_order_and_names():
    t = Taints()
    a, b = t.add("op", False, 1, "forward"), t.add("op", False, 2, "backward")
    s = Sinks(loss=[(None, {"finite": True})], grad=[("w", b), ("v", a)], opt=[("w", "exp_avg", None)])
    c = choose_sink(s, LocalizationPort.opt_name)
    assert (c.kind, c.names, c.taint, c.stage) == ("grad", ["w", "v"], a, "backward")
    s.note_loss(False, b, "nan", [2])
    s.note_loss(True)
    assert s.loss[1:] == [(b, {"finite": False, "value": "nan", "shape": [2]}), (None, {"finite": True})]
    c = choose_sink(s, LocalizationPort.opt_name)
    assert (c.kind, c.names, c.taint, c.stage) == ("loss", ["nan"], b, "forward")
    c = choose_sink(Sinks(grad=None, opt=[("w", None, None), ("w", "exp_avg", None)]), LocalizationPort.opt_name)
    assert (c.kind, c.names, c.taint, c.stage) == ("optimizer", ["w", "w:exp_avg"], None, "optimizer")
    assert choose_sink(Sinks(grad=None, opt=None), LocalizationPort.opt_name).kind is None


class _Port(LocalizationPort):
    shape = OriginShape(keys=("op", "module", "file", "line", "stage", "inputs", "output", "samples"),
                        backward_if="forward_line",
                        from_forward=(("file", "forward_file"), ("line", "forward_line"), ("module", "forward_module")),
                        only_if_set=("module",))
    constant_example = "fill(-inf)"

    def __init__(self) -> None:
        self.trap_calls: list = []

    def where_trap(self, op: int) -> bool:
        self.trap_calls.append(op)
        return True

    def optimizer(self, taint, sinks):
        return OptimizerInfo(param="w", state="exp_avg_sq", hyper={"lr": 0.1, "eps": 1e-8})


def test_localization_of_a_forward_origin_reaching_the_gradients():
    t = Taints()
    o = t.add("op", False, 7, "forward")
    o.detail = {"op": "aten.log.default", "module": "enc", "file": "u.py", "line": 9, "stage": "forward",
                "facts": {"log_domain": {"zeros": 2}}, "mask_escape": {"mask_op": "masked_fill"}, "extra": 1}
    port = _Port()
    loc = build_localization(Sinks(grad=[("w", o)]), t, ["n0"], 42, port)
    d = loc.as_dict()
    assert list(d) == ["reproduced", "phase", "origin", "preexisting", "optimizer", "facts", "n_ops", "notes", "sink",
                       "origins_seen", "masked_nonfinite_origins"]
    assert d["phase"] == "backward" and d["sink"] == {"kind": "grad", "names": ["w"]}
    assert d["origin"] == {"op": "aten.log.default", "module": "enc", "file": "u.py", "line": 9, "stage": "forward",
                           "inputs": [], "output": {"nan": 0, "posinf": 0, "neginf": 0}, "samples": [], "kind": "op"}
    assert d["facts"] == {"log_domain": {"zeros": 2}, "mask_escape": {"mask_op": "masked_fill"}, "where_trap": True}
    assert port.trap_calls == [7] and d["optimizer"] is None and d["notes"] == ["n0"]
    assert o.detail["facts"] == {"log_domain": {"zeros": 2}}        # the taint's description is not consumed


def test_backward_origin_is_named_by_its_forward_op():
    t = Taints()
    o = t.add("op", False, 3, "backward")
    o.detail = {"op": "aten.mul.Tensor", "file": "torch/autograd.py", "line": 1, "forward_file": "u.py",
                "forward_line": 12, "forward_module": None}
    d = build_localization(Sinks(grad=[("w", o)]), t, [], 5, _Port()).as_dict()
    org = d["origin"]
    assert (org["file"], org["line"]) == ("u.py", 12)
    assert (org["backward_file"], org["backward_line"]) == ("torch/autograd.py", 1)
    assert org["module"] is None and "module" in org      # only replaced when the forward op has one
    assert "where_trap" not in d["facts"]                 # a backward origin: no where-trap walk


def test_constant_origin_reaching_the_loss_and_optimizer_info():
    t = Taints()
    c = t.add("constant", True, 0, "forward")
    c.detail = {"op": "fill", "stage": "forward"}
    d = build_localization(Sinks(loss=[(c, {"finite": False, "value": "-inf"})]), t, [], 1, _Port()).as_dict()
    assert d["phase"] == "forward" and d["facts"] == {"intentional_constant": True}
    assert d["notes"] == ["a non-finite constant written by the program (e.g. fill(-inf)) reached the loss"]
    o = t.add("op", False, 4, "optimizer")
    o.detail = {"op": "addcdiv", "stage": "optimizer"}
    d = build_localization(Sinks(opt=[("w", "exp_avg", o)]), t, [], 9, _Port()).as_dict()
    assert d["phase"] == "optimizer" and d["sink"]["names"] == ["w:exp_avg"]
    assert d["optimizer"] == {"param": "w", "state": "exp_avg_sq", "inputs": [], "lr": 0.1, "eps": 1e-8}


def test_preexisting_origin_sets_phase_and_facts():
    t = Taints()
    p = t.add("preexisting", False, 0, "forward")
    p.pre_kind, p.name = "param", "fc.weight"
    p.first_use = {"op": "mm"}
    p.detail = {"stats": {"nonfinite": 3, "numel": 12, "bad_rows": [1]}, "written_by": {"op": "fill_"}}
    d = build_localization(Sinks(loss=[(p, {"finite": False, "value": "nan"})]), t, [], 2, _Port()).as_dict()
    assert d["phase"] == "params" and d["origin"] is None
    assert d["preexisting"] == {"kind": "param", "name": "fc.weight", "samples": [], "source_rows": [],
                                "stats": p.detail["stats"], "rows_in_tensor": [1], "first_use": {"op": "mm"},
                                "written_by": {"op": "fill_"}}
    assert d["facts"] == {"preexisting": {"kind": "param", "name": "fc.weight", "nonfinite": 3, "numel": 12}}
    pre = Preexisting.of(p, [0], [70])
    pre.kind, pre.source_rows_from = "data", "sampler"
    assert pre.phase == "data" and pre.as_dict()["source_rows_from"] == "sampler"
    pre.kind = "optimizer_state"
    assert pre.phase == "optimizer"


def test_not_reproduced_counts_the_masked_origins_and_untraced_sinks_fall_back():
    t = Taints()
    t.add("op", False, 1, "forward")
    t.add("constant", True, 2, "forward")
    t.add("preexisting", True, 3, "forward")
    d = build_localization(Sinks(loss=[(None, {"finite": True})]), t, [], 8, _Port()).as_dict()
    assert not d["reproduced"] and d["phase"] is None and d["masked_nonfinite_origins"] == 2
    assert d["origins_seen"] == 1 and d["sink"] == {"kind": None, "names": []}
    assert d["notes"] == ["2 non-finite intermediate(s) appeared but were masked before reaching the loss, "
                          "gradients or parameters"]
    t2 = Taints()
    f = t2.add("op", False, 0, "forward")
    f.detail = {"op": "exp"}
    d = build_localization(Sinks(grad=[("w", None)]), t2, [], 3, _Port()).as_dict()
    assert d["notes"][0].startswith("the non-finite sink could not be traced") and d["origin"]["op"] == "exp"
    d = build_localization(Sinks(grad=[("w", None)]), Taints(), [], 3, _Port()).as_dict()
    assert d["reproduced"] and d["phase"] == "backward" and d["origin"] is None


def test_backend_keys_and_notes_come_through_the_port():
    class TF(_Port):
        backend, instrumentation, state_word = "tensorflow", "eager op callbacks", "variables"

        def annotate(self, loc, choice):
            loc.loss_scale = 128.0
            loc.notes.append(f"sink {choice.kind}")

    d = build_localization(Sinks(), Taints(), [], 0, TF()).as_dict()
    assert list(d)[8:] == ["sink", "backend", "instrumentation", "origins_seen", "masked_nonfinite_origins",
                           "loss_scale"]
    assert d["notes"] == ["sink None"] and d["loss_scale"] == 128.0


def test_as_dict_round_trip_is_byte_identical():
    loc = Localization(reproduced=True, phase="optimizer", origin={"op": "div", "kind": "op"},
                       preexisting=Preexisting("data", "x", [1], [7], {"bad_rows": [1]}, None, None, "sampler"),
                       optimizer=OptimizerInfo("w", "v", [{"arg": "1"}], ["w:v"], "Adam",
                                               {"lr": 0.001, "betas": [0.9, 0.99]}, "float16", {"value": 1e-8}),
                       facts={"a": 1}, n_ops=3, notes=["x"], sink=Sink("optimizer", ["w:v"]), backend="tensorflow",
                       origins_seen=1, masked_nonfinite_origins=0)
    d = loc.as_dict()
    assert list(d["optimizer"]) == ["param", "state", "inputs", "nonfinite_after_step", "optimizer", "lr", "betas",
                                    "param_dtype", "eps_fact"]
    assert json.dumps(Localization.from_dict(json.loads(json.dumps(d))).as_dict()) == json.dumps(d)
    d["seconds"] = 0.25                                   # added by a driver: kept, last
    back = Localization.from_dict(d)
    assert back.extra == {"seconds": 0.25} and json.dumps(back.as_dict()) == json.dumps(d)
    f = failed_result(4, ["n"], ValueError("boom"), backend="tensorflow")
    assert f["reproduced"] is False and f["notes"] == ["n", "result failed: ValueError('boom')"]
    assert "sink" not in f and f["backend"] == "tensorflow"


def test_origin_dict_defaults_are_fresh():
    shape = OriginShape(keys=("op", "inputs", "output", "samples"), backward_if="forward_idx", from_forward=())
    a, b = origin_dict({}, "op", "forward", shape), origin_dict({}, "op", "forward", shape)
    a["inputs"].append(1)
    a["output"]["nan"] = 5
    assert b["inputs"] == [] and b["output"]["nan"] == 0


def test_source_rows_of_an_index():
    assert source_rows([40, 41, 42, 40], [0, 3, 9]) == [40]
    assert source_rows(list(range(100, 130)), list(range(30))) == list(range(100, 110))


# ---------------------------------------------------------------------------- evidence and naming
def test_gatherers_registry_runs_always_and_wanted_in_order():
    reg = Gatherers()

    @reg.register("a", always=True)
    def _a(p):
        return {"a": len(p.facts)}

    @reg.register("b")
    def _b(p):
        raise RuntimeError("bad input")

    @reg.register("c")
    def _c(p):
        return {"c": True}

    with pytest.raises(ValueError):
        reg.register("a")(lambda p: None)

    class Fam:
        name, evidence = "log", ("b", "c")

    class P(ProbeBase):
        def __init__(self, family, stage="forward", fwd=None, keep=None):
            self.kept = self.examine(stage, fwd, keep or {})
            self.family = family

    assert reg.run(P(None)) == {"a": 0}
    p = P(Fam(), "backward", 3, {3: ("fwd",)})
    assert p.kept == ("fwd",) and p.in_family("log") and not p.in_family("exp")
    assert reg.run(p, catch=True) == {"examined": "forward_op", "a": 1, "b_error": "RuntimeError: bad input",
                                      "c": True}
    with pytest.raises(RuntimeError):
        reg.run(P(Fam()))
    assert P(None, "backward", 3, {}).facts == {"examined": "backward_op"}


def test_user_files_rule(tmp_path):
    lib = tmp_path / "lib"
    users = UserFiles(CN.resolved_dirs([str(lib)]))
    assert users(str(tmp_path / "train.py"))
    assert not users(str(lib / "x.py")) and not users(str(lib))
    assert not users("/venv/lib/site-packages/pkg/m.py") and not users("")
    assert users("<stdin>") and not users("<frozen importlib._bootstrap>")
    assert users(os.path.join(CN.EXAMPLES_DIR, "demo.py"))          # nanguard's own demo is user code
    strict = UserFiles((), pseudo_excluded=CN.PSEUDO_EXCLUDED + ("<decorator-gen",))
    assert not strict("<decorator-gen-12>")

    def flaky(fn: str) -> bool:
        if fn.endswith("boom.py"):
            raise OSError
        return fn.endswith("mine.py")
    own = UserFiles((), flaky)
    assert own("a/mine.py") and not own("a/boom.py") and not own("/x/site-packages/mine2.py")
