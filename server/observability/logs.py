"""Logging setup: readable lines for people, or one JSON object per line for log collectors.

Structured fields travel in ``extra=`` (``event``, ``model``, ``version``, ...)
and appear as keys of the JSON object, so a collector can filter on them
without parsing the message.

With ``fmt="json"`` every line the process writes is one JSON object, not only its log records:
``configure_logging`` also sends Python warnings (the ``warnings`` module, torch's) to the log, and
puts a pipe behind file descriptors 1 and 2 (``StdioCapture``), so what a library writes there
itself (ONNX Runtime's and gRPC's C++ logs, a ``print``) becomes one JSON object a line too, its
level and logger read from the line where its format says them. What the command itself reports
(the plan, READY) it writes with ``emit``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import sys
import threading
import time
from typing import Any, TextIO

__all__ = ["LEVELS", "JsonFormatter", "StdioCapture", "configure_logging", "emit", "json_line", "parse_level",
           "write_line"]

LEVELS = ("debug", "info", "warning", "error", "critical")
"""What ``--log-level`` takes (any case)."""

# Attributes every LogRecord has; anything else came in through ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def _timestamp(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created * 1000) % 1000:03d}Z"


def _jsonable(value: Any) -> Any:
    """Scalars, lists and dicts as they are (a plan travels as a structure); anything else as its text."""
    if isinstance(value, (str, int, float, bool, type(None), list, tuple, dict)):
        return value
    return str(value)


def json_line(message: str, *, level: str = "info", logger: str = "sixfold", created: float | None = None,
              **fields: Any) -> str:
    """One log line as JSON: ``ts``, ``level``, ``logger``, ``message``, then ``fields``."""
    entry = {"ts": _timestamp(time.time() if created is None else created), "level": level, "logger": logger,
             "message": message}
    entry.update((k, _jsonable(v)) for k, v in fields.items())
    return json.dumps(entry, default=str)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = {key: value for key, value in vars(record).items()
                  if key not in _STANDARD and not key.startswith("_")}
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        return json_line(record.getMessage(), level=record.levelname.lower(), logger=record.name,
                         created=record.created, **fields)


def parse_level(text: str) -> str:
    """``--log-level``'s value, upper-cased; ValueError naming the choices."""
    if str(text).lower() not in LEVELS:
        raise ValueError(f"--log-level {text!r}: give one of {', '.join(LEVELS)}")
    return str(text).upper()


# Lines libraries write themselves, and where their level and logger are:
# ONNX Runtime: "2026-01-02 10:11:12.123 [W:onnxruntime:Default, file.cc:12 Func] message"
_ORT = re.compile(r"^\S+ \S+ \[([VIWEF]):onnxruntime:[^,\]]*,?\s*([^\]]*)\]\s?(.*)$")
# gRPC core (absl): "E1127 08:25:50.859294   27737 add_port.cc:83] message"
_GRPC = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ ([^\]]+)\]\s?(.*)$")
_LETTER = {"V": "debug", "I": "info", "W": "warning", "E": "error", "F": "critical"}
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _wrap(line: str, stream: str) -> str | None:
    """A line a library wrote to fd 1 or 2 as one JSON object (passed through when it is one); None: blank."""
    text = _ANSI.sub("", line).rstrip()
    if not text.strip():
        return None
    if text.startswith("{"):
        try:
            if isinstance(json.loads(text), dict):
                return text
        except ValueError:
            pass
    if match := _ORT.match(text):
        letter, where, message = match.groups()
        return json_line(message, level=_LETTER[letter], logger="onnxruntime", source=where.strip())
    if match := _GRPC.match(text):
        letter, where, message = match.groups()
        return json_line(message, level=_LETTER[letter], logger="grpc", source=where.strip())
    return json_line(text.strip(), level="info" if stream == "stdout" else "warning", logger=stream)


class StdioCapture:
    """File descriptors 1 and 2 through pipes: each line written to them comes out as one JSON object.

    A pump thread per descriptor reads its pipe and writes each line to the original stdout or
    stderr: a JSON object as it is, any other line wrapped as one (``_wrap``). The command's own
    lines and the log records (``write``) go into the same pipes, so each stream keeps the order
    its lines were written in. ``close`` (also at exit) puts the original descriptors back once the
    pipes are read to the end.
    """

    def __init__(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self._lock = threading.Lock()
        """One writer at a time into the pipes (a line of more than PIPE_BUF bytes is several writes)."""
        self._saved = (os.dup(1), os.dup(2))
        self._out_lock = threading.Lock()
        self.stdout: TextIO = os.fdopen(os.dup(self._saved[0]), "w", buffering=1, encoding="utf-8",
                                        errors="replace")
        self.stderr: TextIO = os.fdopen(os.dup(self._saved[1]), "w", buffering=1, encoding="utf-8",
                                        errors="replace")
        self._pumps: list[threading.Thread] = []
        for fd, name in ((1, "stdout"), (2, "stderr")):
            read, write = os.pipe()
            os.dup2(write, fd)
            os.close(write)
            pump = threading.Thread(target=self._pump, args=(read, name), name=f"json-{name}", daemon=True)
            pump.start()
            self._pumps.append(pump)
        self._closed = False
        atexit.register(self.close)

    def write(self, line: str, stream: str = "stdout") -> None:
        """A JSON line into the pipe of fd 1 (``stream`` "stdout") or 2, after what Python holds for it."""
        fd = 1 if stream == "stdout" else 2
        # NOTE: a newline first ends a partial line a library left (the pumps skip blank lines)
        data = ("\n" + line + "\n").encode("utf-8", errors="replace")
        with self._lock:
            try:
                (sys.stdout if fd == 1 else sys.stderr).flush()
                while data:
                    data = data[os.write(fd, data):]
            except (OSError, ValueError):  # the reader went away (a closed pipe): nothing to tell it
                pass

    def write_original(self, line: str, stream: str = "stdout") -> None:
        """``line`` as it is to the original stdout or stderr, past the pipes (a line another process reads)."""
        out = self.stdout if stream == "stdout" else self.stderr
        with self._out_lock:
            try:
                out.write(line + "\n")
                out.flush()
            except (OSError, ValueError):
                pass

    def _pump(self, fd: int, name: str) -> None:
        pending = b""
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while True:
                chunk = pipe.read(65536)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    self._write_wrapped(raw, name)
        if pending:
            self._write_wrapped(pending, name)

    def _write_wrapped(self, raw: bytes, name: str) -> None:
        line = _wrap(raw.decode("utf-8", errors="replace"), name)
        if line is not None:
            self.write_original(line, name)

    def close(self, timeout_s: float = 2.0) -> None:
        """The original fd 1 and 2 back; what the pipes still hold is written first (up to ``timeout_s``)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os.dup2(self._saved[0], 1)  # the pipes' last write ends close: the pumps read to the end and stop
            os.dup2(self._saved[1], 2)
        for pump in self._pumps:
            pump.join(timeout_s)
        for fd in self._saved:
            os.close(fd)


_capture: StdioCapture | None = None


def emit(message: str, *, level: str = "info", logger: str = "sixfold", stream: str = "stdout",
         **fields: Any) -> None:
    """One JSON line, whatever the log level (what a command reports: its plan, READY): to the original
    stdout (or stderr) when ``configure_logging`` captures them, else to ``sys.stdout`` (``sys.stderr``)."""
    line = json_line(message, level=level, logger=logger, **fields)
    if _capture is not None:
        _capture.write(line, stream)
    else:
        out = sys.stdout if stream == "stdout" else sys.stderr
        print(line, file=out, flush=True)


def write_line(line: str, stream: str = "stdout", *, past_capture: bool = False) -> None:
    """``line`` as it is: a JSON object into the captured stream (in order with the rest), or with
    ``past_capture`` straight to the original one (a line another process reads verbatim)."""
    if _capture is not None:
        if past_capture:
            _capture.write_original(line, stream)
        else:
            _capture.write(line, stream)
    else:
        print(line, file=sys.stdout if stream == "stdout" else sys.stderr, flush=True)


class _CaptureHandler(logging.Handler):
    """Log records as JSON lines on the captured process's original stderr."""

    def __init__(self, capture: StdioCapture) -> None:
        super().__init__()
        self.capture = capture

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.capture.write(self.format(record), "stderr")
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


def _log_uncaught(exc_type, exc, tb) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    logging.getLogger("sixfold").critical("uncaught %s: %s", exc_type.__name__, exc, exc_info=(exc_type, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    logging.getLogger("sixfold").critical("uncaught %s in thread %s: %s", args.exc_type.__name__,
                                          getattr(args.thread, "name", "?"), args.exc_value,
                                          exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def configure_logging(level: str = "INFO", fmt: str = "text", *, capture_stdio: bool = True) -> StdioCapture | None:
    """Root logging for the server process: ``fmt`` "text" or "json"; ValueError names a bad level or format.

    ``fmt="json"``: Python warnings go to the log (logger ``py.warnings``), uncaught exceptions are
    one record each, and (unless ``capture_stdio`` is False) fd 1 and 2 are captured (``StdioCapture``,
    returned: close it when done). At ``level`` ERROR and above, ONNX Runtime's C++ log says errors only.
    """
    global _capture
    level = parse_level(level)
    if fmt not in ("text", "json"):
        raise ValueError(f"--log-format {fmt!r}: give text or json")
    root = logging.getLogger()
    if _capture is not None:  # configured again (tests call main twice): the previous capture ends first
        _capture.close()
        _capture = None
    if fmt == "json":
        capture = None
        if capture_stdio:
            try:
                capture = StdioCapture()
            except OSError:  # no fd 1 or 2 to put a pipe behind (a closed descriptor): the records alone
                capture = None
        handler: logging.Handler = _CaptureHandler(capture) if capture else logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread
        _capture = capture
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        capture = None
    root.handlers[:] = [handler]
    root.setLevel(level)
    if level in ("ERROR", "CRITICAL"):  # ONNX Runtime's own C++ log says warnings unless told otherwise
        try:
            import onnxruntime
            onnxruntime.set_default_logger_severity(3)
        except ImportError:  # pragma: no cover - a dependency; nothing to quieten without it
            pass
    return capture
