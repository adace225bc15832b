"""Provenance that ends before the step: a bad sample in the batch, a corrupted parameter or buffer
(with the op that wrote it, when the recorder saw the write), non-finite optimizer state."""
from __future__ import annotations

import os

from .. import fixes as X
from .. import text as T
from .division import MEAN


UNTRACED = "dataset row not traceable"   # how a ``source_rows_note`` says why (tensorflow/rows.py, pytorch Guard)


def positions_only(pre: dict) -> str:
    """When the bad rows of input data are known only as positions in the batch (no dataset rows were
    traced): the clause that says so, with the reason when ``source_rows_note`` gives one; else ''.

    ``samples`` are always batch positions; ``rows_in_tensor`` are rows of the tensor that held the bad
    values, which is the batch itself (its rows are the positions) unless its first dimension differs
    from the batch's (a dataset tensor indexed by the batch's indices: those rows are dataset rows)."""
    rows, tr = pre.get("samples") or [], pre.get("rows_in_tensor") or []
    if pre.get("source_rows") or not rows:
        return ""
    shape = (pre.get("stats") or {}).get("shape") or []
    dim0 = (pre.get("first_use") or {}).get("out_dim0")
    if tr and ((shape and dim0 and shape[0] != dim0) or list(tr[:len(rows)]) != list(rows[:len(tr)])):
        return ""   # the rows of a tensor other than the batch: named as its rows
    note = str(pre.get("source_rows_note") or "")
    why = note.split("; ", 1)[1] if note.startswith("batch position") and "; " in note else note
    why = why[len(UNTRACED):] if why.startswith(UNTRACED) else why
    why = why.strip()
    return "the dataset rows could not be traced" + (
        f" {why}" if why.startswith("through ") else f": {why.lstrip(': ')}" if why else "")


def find_rows_fix(rows: list) -> str:
    """The fix when only batch positions are known: find the dataset rows, then clean or drop them."""
    return (f"batch position(s) {rows} are places in the batch, not dataset rows: find the bad rows in the "
            "data itself, e.g. "
            + X.say(pytorch="bad = torch.nonzero(~torch.isfinite(X).flatten(1).all(dim=1)).flatten() on the "
                            "dataset's tensor (or [i for i in range(len(ds)) if not torch.isfinite(ds[i][0]).all()] "
                            "for a Dataset), or pass the batch's dataset indices to guard.step(batch, loss_fn, "
                            "indices=idx) (or run the script under nanguard run, which traces a DataLoader's rows) "
                            "so the report names them",
                    tensorflow="bad = np.nonzero(~np.isfinite(X).reshape(len(X), -1).all(axis=1))[0] on the arrays "
                               "the input pipeline reads (or print the indices of the batch's rows at that step)",
                    jax="bad = np.nonzero(~np.isfinite(X).reshape(len(X), -1).all(axis=1))[0] on the host arrays "
                        "the batches are cut from")
            + "; then clean or drop those rows at the source (a blank field parsed as NaN?), e.g. "
            + X.finite_filter())


def _source_guess(what: str) -> str:
    """Where values like these usually come from, as a question (the data's history is not known)."""
    if what == "NaN":
        return "a blank field parsed as NaN, or a 0/0 in preprocessing: a constant row standardised by its std of 0?"
    if what == "Inf":
        return "a division by zero in preprocessing (a ratio over a count or an area of 0), or the log of a 0?"
    return "a blank field parsed as NaN, or a division by zero in preprocessing?"


def entry_text(fu: dict) -> str:
    """`` (it enters the computation at <op> of layer 'dense', file:line)``: where the tensor is first read.
    The layer is named with the line, since a layer's line may be where it was built (a Keras Sequential's
    constructor), not where the data was made."""
    if not fu.get("file"):
        return ""
    op, layer = fu.get("op"), fu.get("layer") or fu.get("module")
    what = (f"{op} of layer '{layer}', " if op and layer else f"layer '{layer}', " if layer else f"{op}, " if op else "")
    return f" (it enters the computation at {what}{os.path.basename(str(fu.get('file')))}:{fu.get('line')})"


def preexisting(pre: dict, phase: str, ev: dict, method: str, ctx: dict) -> dict:
    kind, name = pre.get("kind"), pre.get("name")
    st = pre.get("stats") or {}
    ev.update(preexisting=pre)
    n_bad, numel = st.get("nonfinite"), st.get("numel")
    what = "NaN" if st.get("nan") else "Inf" if (st.get("posinf") or st.get("neginf")) else "non-finite"
    owned = [str(n) for n in ((ctx.get("detected") or {}).get("nonfinite_params") or []) if n]
    if kind == "data" and ev.get("detector_phase") == "eval" and owned and not pre.get("source_rows"):
        return model_state_input(pre, owned, what, ev, method)
    if kind == "data":
        src, rows, tr = pre.get("source_rows") or [], pre.get("samples") or [], pre.get("rows_in_tensor") or []
        where = entry_text(pre.get("first_use") or {})
        untraced = positions_only(pre)
        rows_s = f"dataset row(s) {src}" if src else f"batch position(s) {rows}" if untraced \
            else f"row(s) {tr}" if tr else "some rows"
        carry = (f" ({untraced})" if untraced else f"; batch position(s) {rows} carry them into the loss" if rows
                 else "; they reach the loss")
        part = str(pre.get("part") or "")
        if part.startswith(("targets", "sample_weight")):  # not the features: the labels or their weights
            noun = "sample weights" if part.startswith("sample_weight") else \
                f"targets ({'y' + part[len('targets'):]})"
            summ = f"bad input data: the {noun} of {rows_s} hold {n_bad} {what} value(s) of {numel}{carry}{where}"
            fixes = ([find_rows_fix(rows)] if untraced else []) + [(f"the sample weights of {rows_s} are {what}: check how they were computed (a weight of "
                      "1 / count with a zero count, a class weight for a class with no samples) and make every "
                      "weight finite, e.g. sw = np.where(np.isfinite(sw), sw, 0.0), or drop those rows")
                     if part.startswith("sample_weight") else
                     (f"the targets of {rows_s} are {what} and their sample weight is 0: a weight of 0 does not "
                      "mask a NaN target (0 * NaN = NaN in the weighted loss); give those targets any finite "
                      "value, e.g. y = np.where(np.isfinite(y), y, 0.0), and keep the 0 weights")
                     if pre.get("zero_weight") else
                     (f"the targets of {rows_s} are {what} (a missing label?): drop those rows or fill the "
                      "target before training, e.g. keep = np.isfinite(y).reshape(len(y), -1).all(axis=1); "
                      "x, y = x[keep], y[keep]"),
                     "validate the data once before training: every feature, target and weight finite"]
            return T.result("bad_input_data", summ, 0.95, ev, fixes, method)
        asm = pre.get("assembled") or {}
        if asm.get("rows") and src and set(src) <= set(asm["rows"]):  # the dataset's items read finite again
            fn = asm.get("collate_fn")
            head = (f"bad input data: the batch rows from dataset row(s) {src} hold {n_bad} {what} value(s) of "
                    f"{numel}{carry}{where}, but those dataset items read finite again")
            if fn:  # the script's own collate_fn: torch's default one only stacks
                summ = f"{head}: the {what} is made as the batch is assembled, in the DataLoader's collate_fn {fn}"
                fixes = [f"fix the collate_fn {fn}: guard what it computes per item (a division by an item's length, "
                         "count or norm, 0 for an empty item), e.g. x.sum(0) / max(length, 1)",
                         f"or drop the empty items before batching (dataset row(s) {src})"]
            else:
                summ = (f"{head}: a random transform in the dataset's __getitem__ made it this time (torch's default "
                        "collate only stacks)")
                fixes = [f"guard the random transforms of the dataset's __getitem__ (dataset row(s) {src}): a crop or "
                         "mix that can select nothing, a division by a statistic of the transformed item",
                         "validate each item after its transforms (assert torch.isfinite(x).all()) to catch the draw"]
            return T.result("bad_input_data", summ, 0.9, ev, fixes, method)
        made = str(pre.get("made_by_pipeline") or "")
        if made:  # the arrays (or rows) the pipeline slices are finite: a function on the way made the values
            fn = f"{made} function" if "(" not in made and "," not in made else f"mapped functions ({made})"
            summ = (f"bad input data: {rows_s} hold {n_bad} {what} value(s) of {numel}{where}; "
                    + (f"those rows are finite in the arrays the input pipeline slices" if src else
                       "the arrays the input pipeline slices are all finite") + f", so its {fn} made them")
            fixes = [f"guard the arithmetic of the pipeline's {fn}: a division by a value of the row that "
                     "can be 0 (a window divided by its first value, a ratio over a count), the log or sqrt of 0, "
                     "e.g. x / tf.maximum(tf.abs(d), 1e-6) * tf.sign(d), or drop such rows before it with ds.filter",
                     "check the mapped rows once: for x, y in ds.unbatch().take(n): tf.debugging.assert_all_finite("
                     "x, 'mapped row')"]
            return T.result("bad_input_data", summ, 0.9, ev, fixes, method)
        summ = f"bad input data: {rows_s} of the {'batch' if untraced else 'input tensor'} hold {n_bad} {what} value(s) of {numel}{carry}{where}"
        every = rows_s
        if src and tr and not untraced and set(src) < set(tr):  # (src rows index this tensor: it is the dataset)
            # the tensor is the whole dataset (a TensorDataset indexed by the loader): its count covers every
            # bad row, not the ones this batch drew; all of them are named, or a user drops one of seven
            every = f"row(s) {tr[:20]}" + (f" and {len(tr) - 20} more" if len(tr) > 20 else "")
            shape = "x".join(map(str, st.get("shape") or [])) or "?"
            summ = (f"bad input data: the input tensor ({shape}, the dataset) holds {n_bad} "
                    f"{what} value(s) of {numel} in {len(tr)} row(s) {tr[:20]}" + ("..." if len(tr) > 20 else "")
                    + f"; this batch drew {rows_s}{carry}{where}")
        fixes = [find_rows_fix(rows) if untraced else
                 f"clean or drop {every} at the source ({_source_guess(what)}), e.g. " + X.finite_filter(),
                 X.say(pytorch="validate batches in the data loader (assert torch.isfinite(batch).all()) or replace "
                       "missing values (torch.nan_to_num / imputation with the column mean)",
                       tensorflow="validate batches in the input pipeline (" + X.finite_check("x") + ") or replace "
                       "missing values (tf.where(tf.math.is_finite(x), x, 0.0), imputation with the column mean, "
                       "or record_defaults for blank CSV fields)",
                       jax="validate batches before the jitted step (" + X.finite_check("x") + ") or replace "
                       "missing values (np.nan_to_num / imputation with the column mean) when loading the data")]
        return T.result("bad_input_data", summ, 0.95, ev, fixes, method)
    if kind == "buffer" and pre.get("module_type") in ADAPTED_STATISTICS:
        return adapted_statistics(pre, name, what, ev, method)
    if kind == "optimizer_state":
        return T.result("optimizer_numerics", f"optimizer state {name} was already non-finite before the step "
                        f"({n_bad} of {numel} values)", 0.7, ev,
                        ["reset the optimizer state (re-create the optimizer) after restoring finite parameters",
                        "see why a previous update made the state non-finite (eps below the dtype's tiny, "
                        "float16 state)"], method)
    since = (ctx.get("bad_params_since") or {}).get(name)
    # the write the replay saw; else one the run saw between steps (a Keras callback's set_weights)
    wb = pre.get("written_by") or (ctx.get("outside_writes") or {}).get(str(name)) or {}
    rows = st.get("bad_rows") or []
    wb_s, wb_fix = "", None
    if wb.get("file"):
        wop = T.opshort(wb.get("op"))
        at = f"{os.path.basename(str(wb['file']))}:{wb.get('line')}"
        wb_s = f"; the values were written at {at} by {wb.get('api') or wop}"
        wf = wb.get("facts") or {}
        f32w = wf.get("float32_check") or {}
        dti = wf.get("dtype_info") or {}
        if wop in ("_to_copy", "copy", "copy_") and st.get("dtype") in T.LOW_DTYPES and not st.get("nan") \
                and f32w.get("direct_finite"):
            # a cast into float16/bfloat16 of values beyond its range: the weights were fine before it
            summ = (f"{kind} '{name or '?'}' holds {n_bad} Inf value(s) of {numel} before the step uses it: "
                    f"{wb.get('api') or wop} at {at} cast values up to |x| = {T.g(f32w.get('max_abs'))} into "
                    f"{st.get('dtype')}, whose max is {T.g(dti.get('max'))}; in float32 they are finite")
            fixes = [X.say(pytorch=f"keep '{name or 'the parameter'}' in float32: train with torch.autocast (+ "
                           f"GradScaler for float16) instead of casting the model at {at}",
                           tensorflow=f"keep '{name or 'the variable'}' in float32: use "
                           + X.mixed_precision(f"instead of casting the variables at {at}"),
                           jax=f"keep '{name or 'the parameter'}' in float32: use "
                           + X.mixed_precision(f"instead of casting the parameters at {at}")),
                     f"or rescale it before the cast so |x| < {T.g(dti.get('max'))} (e.g. fold a large input "
                     "scale into a normalisation of the inputs instead of the weights), or use bfloat16",
                     f"assert {X.assert_finite_params()} after a cast or a load"]
            return T.result("low_precision_overflow", summ, 0.9, ev, fixes, method)
        if wop in MEAN.ops and 0 in (wb.get("input_numel") or []):
            wb_s += " (the mean of an empty tensor: 0/0 = NaN)"
            wb_fix = (f"fix the write at {at}: the mean is taken over an empty set (0 elements); skip empty "
                      "groups (if mask.any(): ...) or keep the default initialisation for them")
        else:
            wb_fix = f"fix the write at {at}: {wb.get('api') or wop} produced non-finite values that were " \
                     "stored into the parameter"
    summ = (f"{kind} '{name or '?'}' holds {n_bad} {what} value(s) of {numel}"
            + (f" (rows {rows})" if rows else "") + " before the step uses it"
            + (f"; non-finite since step {since}" if since is not None else "") + wb_s)
    fixes = [wb_fix,
             f"{X.reinit(name or 'the parameter')} (or restore it from the last finite checkpoint)"
             + ("" if wb_fix else "; a skip cannot fix a parameter that is already non-finite")]
    fixes.append(f"assert {X.assert_finite_params()} after initialisation / loading")
    return T.result("param_corruption", summ, 0.95, ev, fixes, method)


def model_state_input(pre: dict, owned: list, what: str, ev: dict, method: str) -> dict:
    """An evaluation call's input is non-finite, no dataset row is traced to it, and the watched model's own
    parameters or buffers hold non-finite values: the input was computed from them by the script before
    the call (a sampling loop's ``x = coef[t] * (x - eps * c[t])`` with a schedule buffer that is Inf at one
    ``t``), not read from data. Measured: minDiffusion's superminddpm with a beta schedule reaching 1 builds
    ``oneover_sqrta = 1 / sqrt(alpha)`` = Inf at t = T; training never reads index T, the sampling loop's first
    update does (was bad_input_data, "batch position(s) [0, 1, 2, 3]" of a batch there is none of)."""
    st = pre.get("stats") or {}
    where = entry_text(pre.get("first_use") or {})
    names = ", ".join(f"'{n}'" for n in owned[:5]) + (f" and {len(owned) - 5} more" if len(owned) > 5 else "")
    ev["nonfinite_model_state"] = owned[:20]
    summ = (f"the model's own state is non-finite: {names} hold(s) {what} values, and the evaluation's input "
            f"({st.get('nonfinite')} {what} value(s) of {st.get('numel')}){where} was computed from it in the "
            "script before the call (no dataset batch carries it)")
    first = owned[0]
    fixes = [f"find where '{first}' became non-finite: assert torch.isfinite(t).all() on it right after it is "
             "built or loaded; a table computed with 1/x, 1/sqrt(x) or log(x) holds Inf where x reaches 0 (a "
             "noise schedule whose beta reaches 1 makes alpha = 0 there): clamp the inputs of that formula "
             "(e.g. betas.clamp(max=0.999)) or compute the table in float64 and check it",
             f"{X.reinit(first)} (or rebuild it from finite values); a skip/rollback cannot fix state that is "
             "non-finite from its construction",
             f"assert {X.assert_finite_params()} (buffers included) after initialisation / loading"]
    return T.result("param_corruption", summ, 0.8, ev, fixes, method)


# layers whose state is statistics computed from the training data before training (Keras ``adapt``): a
# non-finite value there came from the data they were adapted on
ADAPTED_STATISTICS = {"Normalization": "adapt"}


def adapted_statistics(pre: dict, name: str, what: str, ev: dict, method: str) -> dict:
    """A preprocessing layer's adapted statistics (a Keras Normalization's mean/variance) are non-finite: the
    data given to ``adapt`` held missing values (a blank field parsed as NaN): every batch that goes through
    the layer is non-finite, whatever rows it holds."""
    st = pre.get("stats") or {}
    layer = str(name or "?").split(".")[0]
    call = ADAPTED_STATISTICS.get(str(pre.get("module_type")), "adapt")
    cols = st.get("bad_cols") or []
    summ = (f"bad input data: the {pre.get('module_type')} layer '{layer}' holds {st.get('nonfinite')} {what} "
            f"value(s) of {st.get('numel')} in its statistics ('{name}'), computed by {call}() from data with "
            "missing values: every batch that goes through it is non-finite, whatever its rows"
            + (f" (feature column(s) {cols})" if cols else ""))
    fixes = [f"drop or fill the rows with missing values before {call}() and fit (e.g. df = df.dropna(), or "
             "keep = np.isfinite(x).all(axis=1); x, y = x[keep], y[keep]), then adapt again",
             X.say(pytorch="check the statistics once they are computed (assert torch.isfinite(mean).all())",
                   tensorflow=f"check the layer after {call}(): assert np.isfinite(layer.mean).all() and "
                   "np.isfinite(layer.variance).all()",
                   jax="check the statistics once they are computed (assert np.isfinite(mean).all())")]
    return T.result("bad_input_data", summ, 0.9, ev, fixes, method)
