"""Strict JSON (NaN/Inf as strings) and atomic file writes: what every report file goes through."""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Callable


def json_safe(obj: Any) -> Any:
    """Replace NaN/Inf floats by strings: the report must be strict JSON."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


def write_atomic(path: str, write: Callable[[str], None], suffix: str = ".tmp") -> str:
    """Write through ``write(tmp_path)`` then rename over ``path``: readers never see half a file.

    The file gets the permissions a plain ``open(path, "w")`` would give (the temp file's are 0600)."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".nanguard-", suffix=suffix, dir=folder)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def write_json_atomic(path: str, data: Any) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
    write_atomic(path, write, ".json.tmp")




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
