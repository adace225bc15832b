"""Strict JSON (NaN/Inf as strings) and the one atomic, policy-checked writer every nanguard file goes through."""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Callable

from .outputs import check_output
from .text import strip_ansi


def json_safe(obj: Any) -> Any:
    """Replace NaN/Inf floats by strings: the report must be strict JSON. Terminal escape codes copied
    from an exception message are stripped (:func:`nanguard.core.text.strip_ansi`)."""
    if isinstance(obj, str):
        return strip_ansi(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if obj is None or isinstance(obj, (int, bool)):
        return obj
    return strip_ansi(str(obj))


def write_atomic(path: str, write: Callable[[str], None], suffix: str = ".tmp", *, kind: str) -> str:
    """The one writer of every file nanguard writes (JSON report, HTML page, repro bundle).

    Checks ``path`` against the output policy (:func:`nanguard.core.outputs.check_output`: a new
    path, or a nanguard file of this ``kind``; never a directory, device, FIFO or a user's file),
    writes through ``write(tmp_path)`` in the same folder, then renames over it: readers never see
    half a file. A symbolic link is kept and its target written. The file gets the permissions a
    plain ``open(path, "w")`` would give (the temp file's are 0600). Returns the absolute path."""
    path = check_output(path, kind)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".nanguard-", suffix=suffix, dir=folder)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        check_output(path, kind)  # again, right before the rename: it may have changed while we wrote
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def write_json_atomic(path: str, data: Any, *, kind: str = "report") -> str:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
    return write_atomic(path, write, ".json.tmp", kind=kind)


def _umask() -> int:
    """The process umask, read without changing it (Linux), else the usual 022."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022
