"""Reading a saved JSON report for ``nanguard report`` / ``nanguard show``, with clear errors."""
from __future__ import annotations

import json
import os
from typing import Any, Dict


class ReportFileError(Exception):
    """The file is missing, unreadable, not JSON or not a nanguard report (the CLI exits 2)."""


def load_report(path: str) -> Dict[str, Any]:
    """The report dict in ``path``; raises :class:`ReportFileError` with a one-line reason."""
    if not os.path.exists(path):
        raise ReportFileError(f"no such report: {path}")
    if os.path.isdir(path):
        raise ReportFileError(f"{path} is a directory, not a JSON report")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except UnicodeDecodeError as e:
        raise ReportFileError(f"{path} is not a text (JSON) file: {e.reason}") from None
    except json.JSONDecodeError as e:
        raise ReportFileError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except OSError as e:
        raise ReportFileError(f"cannot read {path}: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise ReportFileError(f"{path} is not a nanguard report (a JSON {type(data).__name__}, not an object)")
    schema = data.get("schema")
    if not (isinstance(schema, str) and schema.startswith("nanguard.report/")):
        raise ReportFileError(f"{path} is not a nanguard report (schema {schema!r}, "
                              "expected 'nanguard.report/1')")
    for key in ("events", "history", "info"):
        if key in data and data[key] is not None and not isinstance(data[key], list):
            raise ReportFileError(f"{path}: '{key}' should be a list, not {type(data[key]).__name__}")
    if any(not isinstance(e, dict) for e in data.get("events") or []):
        raise ReportFileError(f"{path}: every entry of 'events' should be an object")
    return data
