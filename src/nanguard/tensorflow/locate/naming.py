"""Names users recognise: the Keras layer, the user's file and line of an op.

Rules (``/work/shared/scenarios/keras/README.md``, "origin_line"):

* an op written in the user's code (a custom layer's ``call``, a custom loss function, a ``Lambda``'s
  function, a custom train step): the line where that op is written (the innermost user frame of
  the Python stack when the op runs);
* an op inside a built-in Keras layer or loss (``Dense``, ``BatchNormalization``,
  ``SparseCategoricalCrossentropy``): the line where that layer/loss was **constructed**. Containers
  (``Functional``, ``Sequential``, Keras' ``CompileLoss``) are transparent: an op of a ``Dense``
  inside a ``Sequential`` is the ``Dense``'s. A built-in layer called by another built-in layer
  (``EinsumDense`` inside ``MultiHeadAttention``) is named by the outer one, the one the user wrote.

The construction line needs :func:`install_construction_hook` (wraps ``Layer.__new__`` and
``Loss.__new__`` to remember the user frame of each construction, weakly keyed), installed before
the model is built (``nanguard run`` installs it before the script's first line). Without it the
fallback is a scan of the user's source for the layer's constructor call when it is unambiguous
(one call of that class, or one with that explicit ``name=``), else the user line that called the
layer (a custom layer's ``call``, a train step's ``model(x)``), else no line: a model that Keras itself
called (``fit``'s train step) has no user line of its own, and the ``fit`` line would name nothing
(``line_source`` says which: ``constructor``, ``constructor_scan``, ``call_site``, ``not_known``).
Importing ``nanguard.keras`` installs the hook for the rest of the process (the callback's users
build their model after that import).

While the recorder is armed, :class:`ComponentStack` wraps ``Layer.__call__`` and ``Loss.__call__``
to know which layers/losses are running, with the Python frame of each call, so that each op's
location is decided from the live stack in one walk.
"""
from __future__ import annotations

import ast
import os
import sys
import threading
import weakref
from typing import Any, Callable, Dict, Optional

from ...core.locate.naming import PACKAGE_DIR, PSEUDO_EXCLUDED, resolved_dirs, stdlib_dirs
from ...core.locate.naming import UserFiles as _UserFiles

_CTOR: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()
_CTOR_BY_ID: dict[int, tuple] = {}      # for unhashable objects (kept with a weakref check)
_hook_lock = threading.Lock()
_hook_count = 0


# ---------------------------------------------------------------------------- user files
def _excluded_dirs() -> tuple[str, ...]:
    """Not the user's code: nanguard, TensorFlow, Keras and their dependencies, the standard library and
    the installed packages."""
    dirs = {PACKAGE_DIR}
    for mod in ("tensorflow", "keras", "numpy", "ml_dtypes", "absl", "optree", "tf_keras", "google", "h5py"):
        m = sys.modules.get(mod)
        f = getattr(m, "__file__", None) if m is not None else None
        if f:
            dirs.add(os.path.dirname(f))
    return resolved_dirs(dirs | stdlib_dirs(("stdlib", "platstdlib", "purelib", "platlib")))


class UserFiles(_UserFiles):
    """Decides (and caches) whether a file is the user's (the core's rule, TensorFlow's directories)."""

    def __init__(self, user_file_filter: Optional[Callable[[str], bool]] = None):
        super().__init__(_excluded_dirs(), user_file_filter, PSEUDO_EXCLUDED + ("<decorator-gen",))


_DEFAULT_USER: Optional[UserFiles] = None


def default_user_files() -> UserFiles:
    global _DEFAULT_USER
    if _DEFAULT_USER is None:
        _DEFAULT_USER = UserFiles()
    return _DEFAULT_USER


# ---------------------------------------------------------------------------- construction hook
def _remember(obj: Any, site: tuple) -> None:
    try:
        if obj not in _CTOR:
            _CTOR[obj] = site
        return
    except TypeError:
        pass
    if id(obj) not in _CTOR_BY_ID:
        try:
            _CTOR_BY_ID[id(obj)] = (weakref.ref(obj), site)
        except TypeError:
            pass


def construction_site(obj: Any) -> Optional[tuple]:
    """(file, line, function) where the user constructed ``obj`` (recorded by the hook), or None."""
    try:
        s = _CTOR.get(obj)
        if s is not None:
            return s
    except TypeError:
        pass
    e = _CTOR_BY_ID.get(id(obj))
    if e is not None and e[0]() is obj:
        return e[1]
    return None


def _ctor_frame(start: Any) -> Optional[tuple]:
    """The innermost user frame from ``start`` outward (the constructor call's site)."""
    users = default_user_files()
    f = start
    while f is not None:
        code = f.f_code
        if users(code.co_filename):
            return (code.co_filename, f.f_lineno, code.co_name)
        if code.co_filename.endswith("compile_utils.py") and code.co_name in ("build", "__init__"):
            # a loss Keras builds from compile(loss="mse") at the first fit step: the user named it in compile
            owner = f.f_locals.get("self")
            if type(owner).__name__ == "CompileLoss":
                site = construction_site(owner)
                if site is not None:
                    return site
        f = f.f_back
    return None


def _keyword_line(site: tuple, call: str, keyword: str) -> tuple:
    """``site`` moved to the line of ``keyword=`` in the ``call(...)`` spanning it (``compile(\n loss="mse")``:
    the loss's own line), else ``site``."""
    path, line, fn = site
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return site
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == call \
                and node.lineno <= line <= (node.end_lineno or node.lineno):
            kw = next((k for k in node.keywords if k.arg == keyword), None)
            if kw is not None:
                return (path, kw.value.lineno, fn)
    return site


def _wrap_new(cls: Any) -> None:
    """Wrap ``cls.__new__`` (``__init__`` cannot be wrapped: Keras reads its signature for configs).
    ``__new__`` runs in the frame that constructs the object, before any ``__init__``.

    The wrapper stays on the class for the life of the process and records only while a hook is
    installed: CPython cannot take an assigned ``__new__`` back (after ``del cls.__new__`` the class's
    constructor slot keeps routing through ``object.__new__`` with the call's arguments, and every
    later ``Layer(...)`` with arguments raises "object.__new__() takes exactly one argument")."""
    cur = cls.__dict__.get("__new__")
    if getattr(cur.__func__ if isinstance(cur, staticmethod) else cur, "_nanguard_ctor_hook", False):
        return  # wrapped earlier in this process
    orig = cls.__dict__.get("__new__")
    base_new = orig.__func__ if isinstance(orig, staticmethod) else orig

    def __new__(klass, *args, **kwargs):  # noqa: N807
        if base_new is not None:
            obj = base_new(klass, *args, **kwargs)
        else:
            obj = object.__new__(klass)
        if _hook_count <= 0:
            return obj
        try:
            if construction_site(obj) is None:
                site = _ctor_frame(sys._getframe(1))
                if site is not None and klass.__name__ == "CompileLoss":
                    site = _keyword_line(site, "compile", "loss")
                if site is not None:
                    _remember(obj, site)
        except Exception:
            pass
        return obj

    __new__._nanguard_ctor_hook = True  # type: ignore[attr-defined]
    cls.__new__ = staticmethod(__new__)


def install_construction_hook() -> Callable[[], None]:
    """Record the user line where each Keras layer and loss is constructed (``Layer.__new__`` and
    ``Loss.__new__`` wrapped; the sites are weakly keyed by the object). Install before the model is
    built. Returns the uninstall callable; nested installs are counted."""
    global _hook_count
    with _hook_lock:
        _hook_count += 1
        if _hook_count == 1:
            try:
                from keras.src.layers.layer import Layer
                from keras.src.losses.loss import Loss
                _wrap_new(Layer)
                _wrap_new(Loss)
            except Exception:
                _hook_count = 0
                raise
    done = [False]

    def uninstall() -> None:
        global _hook_count
        with _hook_lock:
            if done[0]:
                return
            done[0] = True
            _hook_count -= 1  # the wrappers stay (see _wrap_new) and stop recording at 0
    return uninstall


def construction_hook_installed() -> bool:
    return _hook_count > 0


# ---------------------------------------------------------------------------- source scan fallback
_SCAN_CACHE: dict[str, Optional[list]] = {}


def _calls_in(path: str) -> Optional[list]:
    """[(class name, line, name= kwarg or None)] of every call expression in a file."""
    if path in _SCAN_CACHE:
        return _SCAN_CACHE[path]
    out: Optional[list] = None
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
        out = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func
                nm = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
                if nm is None:
                    continue
                kw = next((k.value.value for k in node.keywords if k.arg == "name"
                           and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)), None)
                out.append((nm, node.lineno, kw))
    except Exception:
        out = None
    _SCAN_CACHE[path] = out
    return out


def scan_construction(obj: Any, files: list[str]) -> Optional[tuple]:
    """Best effort without the hook: the unique call of ``obj``'s class (or the unique one with its
    explicit ``name=``) in the user's files. None when ambiguous."""
    cls = type(obj).__name__
    name = getattr(obj, "name", None)
    hits, named = [], []
    for path in dict.fromkeys(f for f in files if f and not f.startswith("<")):
        calls = _calls_in(path)
        for nm, line, kw in calls or ():
            if nm == cls:
                hits.append((path, line, kw))
                if kw is not None and kw == name:
                    named.append((path, line, kw))
    if len(named) == 1:
        return (named[0][0], named[0][1], "<module>")
    if len(hits) == 1 and (hits[0][2] is None or hits[0][2] == name):
        return (hits[0][0], hits[0][1], "<module>")
    return None


# ---------------------------------------------------------------------------- components while armed
def _is_builtin(obj: Any) -> bool:
    """A Keras-provided class (its code is not the user's)."""
    mod = type(obj).__module__ or ""
    return mod.startswith(("keras.", "tf_keras.", "tensorflow."))


_CONTAINERS = {"Functional", "Sequential", "CompileLoss", "Model", "LossWrapper"}


def _is_container(obj: Any) -> bool:
    if not _is_builtin(obj):
        return False
    return type(obj).__name__ in _CONTAINERS


class _Comp:
    __slots__ = ("obj", "frame", "kind", "builtin", "container")

    def __init__(self, obj: Any, frame: Any, kind: str):
        self.obj, self.frame, self.kind = obj, frame, kind
        self.builtin = _is_builtin(obj)
        self.container = _is_container(obj)


class ComponentStack:
    """Wraps ``Layer.__call__`` / ``Loss.__call__`` while armed: the running layers and losses, each
    with the frame of its call. Only the recording thread is tracked."""

    def __init__(self) -> None:
        self.stack: list[_Comp] = []
        self.roots: list[Any] = []   # outermost layers seen (the models)
        self._orig: list[tuple[Any, Any]] = []
        self._thread: Optional[int] = None
        self.active = False
        self.on_root: Optional[Callable[[Any], None]] = None   # called with each new outermost layer

    def install(self) -> None:
        from keras.src.layers.layer import Layer
        from keras.src.losses.loss import Loss
        self._thread = threading.get_ident()
        me = self
        for cls, kind in ((Layer, "layer"), (Loss, "loss")):
            orig = cls.__dict__["__call__"]

            def make(orig=orig, kind=kind):
                def __call__(obj, *args, **kwargs):  # noqa: N807
                    if not me.active or threading.get_ident() != me._thread:
                        return orig(obj, *args, **kwargs)
                    c = _Comp(obj, sys._getframe(), kind)
                    if kind == "layer" and not any(x.kind == "layer" for x in me.stack):
                        if not any(r is obj for r in me.roots):
                            me.roots.append(obj)
                            if me.on_root is not None:
                                try:
                                    me.on_root(obj)
                                except Exception:
                                    pass
                    me.stack.append(c)
                    try:
                        return orig(obj, *args, **kwargs)
                    finally:
                        if me.stack and me.stack[-1] is c:
                            me.stack.pop()
                        else:
                            try:
                                me.stack.remove(c)
                            except ValueError:
                                pass
                __call__._nanguard_comp = True  # type: ignore[attr-defined]
                __call__.__wrapped__ = orig  # type: ignore[attr-defined]
                return __call__
            self._orig.append((cls, orig))
            cls.__call__ = make()
        self.active = True

    def uninstall(self) -> None:
        self.active = False
        for cls, orig in reversed(self._orig):
            cur = cls.__dict__.get("__call__")
            if getattr(cur, "_nanguard_comp", False):
                cls.__call__ = orig
        self._orig = []
        self.stack = []


def layer_path(layer: Any, roots: list[Any]) -> str:
    """Module path of a layer as users see it: Keras ``.path`` ("block/dense"), "" for a root model."""
    if any(layer is r for r in roots):
        return ""
    p = str(getattr(layer, "path", None) or getattr(layer, "name", "") or "")
    for r in roots:   # relative to the model, like PyTorch's named_modules (Sequential builds in its scope)
        rn = str(getattr(r, "name", "") or "")
        if rn and p.startswith(rn + "/"):
            return p[len(rn) + 1:]
    return p


class Location:
    """Where one op runs: user frame, layer, and how the line was chosen."""
    __slots__ = ("file", "line", "function", "layer", "layer_obj", "module", "module_type", "layer_stack",
                 "line_source", "component", "op_frame")

    def __init__(self) -> None:
        self.file = self.line = self.function = None
        self.layer = self.layer_obj = self.module = self.module_type = None
        self.layer_stack: list[str] = []
        self.line_source: Optional[str] = None
        self.component: Optional[str] = None
        self.op_frame: Optional[tuple] = None   # innermost user frame (where the model/loss was called)

    def as_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "function": self.function, "layer": self.layer,
                "module": self.module, "module_type": self.module_type, "layer_stack": list(self.layer_stack),
                "line_source": self.line_source, "component": self.component}


def custom_gradient_frame(frame: Any, users: UserFiles) -> Optional[tuple]:
    """(file, line, function) of the user's gradient function of a ``tf.custom_gradient`` that is running
    the op (innermost ``frame`` outward), or None: a backward op in a gradient the user wrote, whose own
    line is where it was born (not the forward op it differentiates)."""
    f, user = frame, None
    while f is not None:
        fn = f.f_code.co_filename
        if user is None:
            if users(fn):
                user = (fn, f.f_lineno, f.f_code.co_name)
        elif fn.endswith("custom_gradient.py"):   # the user frame was called by TF's custom-gradient machinery
            return user
        elif users(fn):
            return None
        f = f.f_back
    return None


def resolve(frame: Any, comps: ComponentStack, users: UserFiles) -> Location:
    """Decide an op's location from the live Python stack (innermost ``frame`` outward)."""
    loc = Location()
    stack = comps.stack
    layers = [c for c in stack if c.kind == "layer"]
    if layers:
        inner = next((c for c in reversed(layers) if not c.container), layers[-1])
        loc.layer_obj = inner.obj
        loc.layer = getattr(inner.obj, "name", None)
        loc.module = layer_path(inner.obj, comps.roots)
        loc.module_type = type(inner.obj).__name__
        loc.layer_stack = [str(getattr(c.obj, "name", "?")) for c in layers]
    ci = len(stack) - 1
    best: Optional[_Comp] = None
    user_seg: Optional[tuple] = None   # a user frame in the current segment
    first_user: Optional[tuple] = None
    f = frame
    decided: Optional[tuple] = None
    how = None
    sched: Any = None
    while f is not None:
        if ci >= 0 and f is stack[ci].frame:
            # crossing the call of component stack[ci]
            c = stack[ci]
            ci -= 1
            if user_seg is not None:
                decided, how = (user_seg, "op") if best is None else (_ctor_of(best, loc), "constructor")
                break
            if c.container:
                if best is not None:
                    decided, how = _ctor_of(best, loc), "constructor"
                    break
                continue
            if c.builtin:
                best = c
            else:
                # a user class whose call holds no user frame above the op: a built-in method it
                # inherits (a subclass of Dense): named like a built-in
                best = c
            f = f.f_back
            continue
        code = f.f_code
        if users(code.co_filename):
            fr = (code.co_filename, f.f_lineno, code.co_name)
            if user_seg is None:
                user_seg = fr
            if first_user is None:
                first_user = fr
        elif sched is None and user_seg is None and code.co_filename.endswith("learning_rate_schedule.py"):
            sched = f.f_locals.get("self")  # a built-in schedule's own op (the optimizer evaluating its rate)
        f = f.f_back
    else:
        if best is not None:
            decided, how = _ctor_of(best, loc), "constructor"
        elif user_seg is not None:
            decided, how = user_seg, "op"
    if how == "constructor" and best is not None:
        loc.component = f"{type(best.obj).__name__}({getattr(best.obj, 'name', '')})"
        if decided is None:   # no hook: unique constructor call in the user's source, else the call site
            g = f
            while g is not None and first_user is None:   # the user frame that called the model
                if users(g.f_code.co_filename):
                    first_user = (g.f_code.co_filename, g.f_lineno, g.f_code.co_name)
                g = g.f_back
            files = [x[0] for x in (user_seg, first_user) if x]
            main = getattr(sys.modules.get("__main__"), "__file__", None)
            if main:
                files.append(main)
            decided = scan_construction(best.obj, files)
            how = "constructor_scan" if decided is not None else "call_site"
            if decided is None:
                # the user line that called the layer (a custom layer's call, a train step's model call); a
                # model that Keras called (fit's train step) has none: the fit line would say nothing
                decided = user_seg or _user_caller(stack[0], users) if stack else user_seg
                if decided is None:
                    how = "not_known"
    if sched is not None and _is_builtin(sched) and how in (None, "op"):
        # a Keras schedule's op (CosineDecayRestarts' log of a shrinking cycle): the line that built the schedule,
        # not the fit call the optimizer ran under
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        built = scan_construction(sched, [x[0] for x in (user_seg, first_user) if x] + ([main] if main else []))
        if built is not None:
            decided, how = built, "constructor_scan"
            loc.component = type(sched).__name__
    loc.op_frame = first_user
    if decided is not None:
        loc.file, loc.line, loc.function = decided
    loc.line_source = how if decided is not None else None
    return loc


def _user_caller(c: _Comp, users: UserFiles) -> Optional[tuple]:
    """The user frame that called component ``c`` (nanguard's own wrappers between them skipped), or None
    when library code called it (``fit``'s train step calling the model, Keras calling a compiled loss)."""
    f = c.frame.f_back
    while f is not None and os.path.realpath(f.f_code.co_filename).startswith(PACKAGE_DIR + os.sep):
        f = f.f_back
    if f is not None and users(f.f_code.co_filename):
        return (f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
    return None


def _ctor_of(c: _Comp, loc: Location) -> Optional[tuple]:
    return construction_site(c.obj)


def script_site(api: str) -> Dict[str, Any]:
    """A ``written_by`` record of ``api`` at the script's innermost frame now (its file, line, function)."""
    users = default_user_files()
    f = sys._getframe(1)
    while f is not None and not users(f.f_code.co_filename):
        f = f.f_back
    out: Dict[str, Any] = {"api": api, "op": "assign", "kind": "outside_update"}
    if f is not None:
        out.update(file=f.f_code.co_filename, line=f.f_lineno, function=f.f_code.co_name)
    return out


def keras_path(models: Any, var: Any) -> str:
    """The Keras path of ``var`` (a ``tf.Variable`` backing a Keras variable of one of ``models``, or the Keras
    variable itself), as the reports name variables; else its TensorFlow name."""
    for m in list(models):
        for v in getattr(m, "weights", []):
            if v is var or getattr(v, "_value", None) is var:
                return str(v.path)
    return str(getattr(var, "path", None) or getattr(var, "name", "?"))
