"""kvgate's log lines: one format for everything a gateway writes to stderr.

`setup_logging(level, fmt)` gives Python's root logger one handler, so kvgate's own lines,
uvicorn's and hypercorn's (both log through Python logging: the servers are configured
not to install handlers of their own) and the simulator child's come out alike:

- `text`, for a terminal: `2026-12-01 14:40:07,123 INFO kvgate.serve: message`;
- `json`, for log collectors: one object per line, `{"time": "2026-12-01T14:40:07.123Z",
  "level": "info", "logger": "kvgate.serve", "message": "..."}`, plus `exception` (the
  traceback's text) when there is one.

Access lines (one per request, `kvgate.access`) skip `LogRecord`s: the relay hands a dict
to `telemetry.log_access`, which writes it in batches (`telemetry.BufferedLineWriter`; a
record and a write per request cost ~15% of the relay's CPU). They carry the same leading
fields: in `json` the record's keys follow `time`, `level` and `logger` in one object; in
`text` the record is the message, as compact JSON. Their timestamps are formatted once a
second (`_Stamps`): a line costs ~0.8-1.0 µs more than the bare `orjson.dumps` of its
record (timeit, side by side). They are written at level `info`: a higher `--log-level`
turns them off.
"""

from __future__ import annotations

import atexit
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

import orjson

from kvgate.gateway.ops.telemetry import BufferedLineWriter, set_access_writer

LogFormat = Literal["text", "json"]
ACCESS_LOGGER = "kvgate.access"
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            line["stack"] = record.stack_info
        return orjson.dumps(line).decode()


def setup_logging(level: str, fmt: LogFormat) -> None:
    """Route every log line of this process to stderr in `fmt`; access lines included."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # Python's warnings too (logger `py.warnings`)
    access = logging.getLogger(ACCESS_LOGGER)
    access.propagate = False
    access.setLevel(logging.CRITICAL + 1)  # lines go to the batched writer, or nowhere
    if root.isEnabledFor(logging.INFO):
        sys.stderr.flush()
        writer = BufferedLineWriter(sys.stderr.fileno())
        set_access_writer(writer, access_line(fmt))
        atexit.register(writer.flush)


def access_line(fmt: LogFormat) -> Callable[[dict[str, Any]], bytes]:
    """How an access record becomes its line, in `fmt` (see the module docstring)."""
    stamps = _Stamps(json=fmt == "json")
    if fmt == "json":
        head = b'","level":"info","logger":"' + ACCESS_LOGGER.encode() + b'",'

        def as_json(record: dict[str, Any]) -> bytes:
            return b'{"time":"' + stamps.now() + head + orjson.dumps(record)[1:]

        return as_json
    tail = b" INFO " + ACCESS_LOGGER.encode() + b": "

    def as_text(record: dict[str, Any]) -> bytes:
        return stamps.now() + tail + orjson.dumps(record)

    return as_text


#: Milliseconds as three digits, made once.
_MILLIS = [b"%03d" % ms for ms in range(1000)]


class _Stamps:
    """Access-line timestamps (a line per request): the date and time are formatted once
    per second, the milliseconds looked up. `json`: UTC, ISO 8601
    (`2026-12-01T14:40:07.123Z`); else local time as `logging.Formatter`'s default
    (`2026-12-01 14:40:07,123`). Used from the event loop's thread only."""

    __slots__ = ("_head", "_json", "_second", "_tail")

    def __init__(self, *, json: bool) -> None:
        self._json = json
        self._second = -1
        self._head = b""
        self._tail = b"Z" if json else b""

    def now(self) -> bytes:
        now = time.time()
        second = int(now)
        if second != self._second:
            if self._json:
                text = time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(second))
            else:
                text = time.strftime("%Y-%m-%d %H:%M:%S,", time.localtime(second))
            self._head = text.encode()
            self._second = second
        return self._head + _MILLIS[int((now - second) * 1000)] + self._tail


def _iso(created: float) -> str:
    """UTC, ISO 8601, milliseconds: `2026-12-01T14:40:07.123Z`."""
    millis = int((created - int(created)) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{millis:03d}Z"
