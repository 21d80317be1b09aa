"""``sixfold-delta``: make a table delta, apply it to a running server, roll it back.

    sixfold-delta make OLD_VERSION_DIR NEW_VERSION_DIR --out DELTA [--base-sequence N]
    sixfold-delta apply --url HOST:PORT --model NAME [--control-token-file F] [--server-path] DELTA
    sixfold-delta rollback --url HOST:PORT --model NAME [--control-token-file F] [--from-sequence N]
    sixfold-delta show DELTA

``apply`` and ``rollback`` speak stock KServe v2 gRPC: tritonclient's ``load_model`` (Triton's
RepositoryModelLoad), its ``config`` carrying sixfold's delta parameters and its ``files`` the
delta's files (or, with ``--server-path``, the delta folder's path on the server's machine).
See docs/deltas.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

__all__ = ["main", "apply_delta", "rollback_delta"]


def _client(url: str, ssl: bool = False):
    import tritonclient.grpc as grpcclient
    return grpcclient.InferenceServerClient(url, ssl=ssl)


def _headers(token: str | None) -> dict[str, str] | None:
    return {"authorization": f"Bearer {token}"} if token else None


def _sequence(client, model: str, headers) -> str:
    config = client.get_model_config(model, headers=headers, as_json=True)["config"]
    return config.get("parameters", {}).get("sixfold.delta_sequence", {}).get("string_value", "?")


def apply_delta(url: str, model: str, delta: str | Path, *, token: str | None = None, server_path: bool = False,
                timeout_s: float = 600.0, ssl: bool = False) -> str:
    """Apply the delta folder ``delta`` to ``model`` at ``url``; returns the sequence the model serves after it."""
    from sixfold.partitioner.tables.deltas import read_delta

    delta = Path(delta)
    client = _client(url, ssl)
    headers = _headers(token)
    if server_path:
        config = {"parameters": {"sixfold.delta_path": {"string_value": str(delta.resolve())}}}
        client.load_model(model, headers=headers, config=json.dumps(config), client_timeout=timeout_s)
    else:
        read_delta(delta)  # refuse a damaged delta here, before sending it
        files = {f"file:{p.name}": p.read_bytes() for p in sorted(delta.iterdir()) if p.is_file()}
        client.load_model(model, headers=headers, config=json.dumps({"parameters": {}}), files=files,
                          client_timeout=timeout_s)
    return _sequence(client, model, headers)


def rollback_delta(url: str, model: str, *, token: str | None = None, timeout_s: float = 600.0,
                   ssl: bool = False, from_sequence: int | None = None) -> str:
    """Roll back the last delta applied to ``model``; returns the sequence it serves after it.

    The rollback is conditional on the sequence served: ``from_sequence``, else the one read just before.
    A retry after a lost reply must pass the first try's ``from_sequence``: the server then refuses it
    (FAILED_PRECONDITION) instead of undoing a second delta."""
    client = _client(url, ssl)
    headers = _headers(token)
    if from_sequence is None:
        served = _sequence(client, model, headers)
        from_sequence = int(served) if served.isdigit() else None
    key, value = (("sixfold.delta_rollback", "true") if from_sequence is None
                  else ("sixfold.delta_rollback_from", str(from_sequence)))
    config = {"parameters": {key: {"string_value": value}}}
    client.load_model(model, headers=headers, config=json.dumps(config), client_timeout=timeout_s)
    return _sequence(client, model, headers)


def _parser() -> argparse.ArgumentParser:
    from sixfold.partitioner.cli import DefaultsHelpFormatter, OneLineParser
    # NOTE: the docstring's first two paragraphs (the commands), without reST's double backquotes
    description = "\n\n".join(__doc__.split("\n\n")[:2]).replace("``", "")
    p = OneLineParser(prog="sixfold-delta", description=description, formatter_class=DefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{make,apply,rollback,show}")
    make = sub.add_parser("make", help="write the rows that differ between two version folders as a delta")
    make.add_argument("old", help="the version folder the delta applies to (sixfold-partition --out)")
    make.add_argument("new", help="the version folder with the new rows")
    make.add_argument("--out", required=True, help="the delta folder to write")
    make.add_argument("--base-sequence", type=int, default=0,
                      help="the sequence OLD is served at (0: as written; N: after N deltas)")
    make.add_argument("--model", help="the model's name as served (default: the plan's model, e.g. rm2)")
    make.add_argument("--quiet", action="store_true", help="no progress bar")
    for name, text in (("apply", "apply a delta to a running sixfold-serve"),
                       ("rollback", "roll back the last delta applied to a model")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--url", default="127.0.0.1:8001", help="the server's gRPC HOST:PORT")
        cmd.add_argument("--model", required=True)
        token = cmd.add_mutually_exclusive_group()
        token.add_argument("--control-token-file", metavar="PATH",
                           help="a file whose first line is the server's control token (default "
                                "$SIXFOLD_CONTROL_TOKEN)")
        token.add_argument("--control-token", help="the token itself: any local user can read it in the process "
                                                   "list; prefer --control-token-file or $SIXFOLD_CONTROL_TOKEN")
        cmd.add_argument("--ssl", action="store_true", help="gRPC over TLS")
        cmd.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server")
        if name == "rollback":
            cmd.add_argument("--from-sequence", type=int, default=None, metavar="N",
                             help="roll back only if the model serves sequence N (default: the sequence read just "
                                  "before); a retry after a lost reply passes the first try's N and changes nothing")
        if name == "apply":
            cmd.add_argument("delta", help="the delta folder")
            cmd.add_argument("--server-path", action="store_true",
                             help="send the folder's path, not its files (the server reads it; for large deltas)")
    show = sub.add_parser("show", help="check a delta folder and say what it holds")
    show.add_argument("delta")
    return p


def _check_paths(args: argparse.Namespace) -> None:
    """The folders a command reads and writes, before it reads tables or reaches a server."""
    from sixfold.partitioner.cli import check_input_dir, check_output_dir
    if args.command == "make":
        for flag, path in (("OLD_VERSION_DIR", args.old), ("NEW_VERSION_DIR", args.new)):
            check_input_dir(path, flag, "a model version folder (sixfold-partition --out writes one)")
        check_output_dir(args.out, "--out")
    elif args.command == "show" or (args.command == "apply" and not args.server_path):
        check_input_dir(args.delta, "DELTA", "a delta folder (sixfold-delta make --out writes one)")


def _token(args: argparse.Namespace) -> str | None:
    """The control token: --control-token-file's first line, --control-token (warned: argv is public), or
    $SIXFOLD_CONTROL_TOKEN; UsageError naming the file if it cannot be read or is empty."""
    from sixfold.partitioner.cli import read_token_file
    if getattr(args, "control_token_file", None):
        return read_token_file(args.control_token_file, "--control-token-file")
    if getattr(args, "control_token", None):
        print("sixfold-delta: warning: --control-token on the command line: any local user can read it in the "
              "process list; give --control-token-file PATH or $SIXFOLD_CONTROL_TOKEN", file=sys.stderr)
        return args.control_token
    return os.environ.get("SIXFOLD_CONTROL_TOKEN") or None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from sixfold.partitioner.cli import UsageError, error_text
    from sixfold.partitioner.tables.deltas import DeltaError, make_delta, read_delta
    try:
        _check_paths(args)
        if args.command in ("apply", "rollback"):
            args.control_token = _token(args)
    except UsageError as exc:
        print(f"sixfold-delta {args.command}: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "make":
            t0 = time.perf_counter()
            delta = make_delta(args.old, args.new, args.out, base_sequence=args.base_sequence, model=args.model,
                               progress=not args.quiet and sys.stdout.isatty())
            print(f"sixfold-delta: wrote {args.out}: {delta.rows} changed rows in {len(delta.tables)} table(s), "
                  f"sequence {delta.base_sequence} -> {delta.sequence} ({time.perf_counter() - t0:.1f} s)")
        elif args.command == "show":
            delta = read_delta(args.delta)
            print(json.dumps({"model": delta.model, "base": {"sequence": delta.base_sequence,
                                                             "fingerprint": delta.base_fingerprint},
                              "sequence": delta.sequence, "fingerprint": delta.fingerprint, "rows": delta.rows,
                              "tables": {t.table: t.count for t in delta.tables}}, indent=1))
        elif args.command == "apply":
            t0 = time.perf_counter()
            sequence = apply_delta(args.url, args.model, args.delta, token=args.control_token,
                                   server_path=args.server_path, timeout_s=args.timeout, ssl=args.ssl)
            print(f"sixfold-delta: {args.model} serves delta sequence {sequence} ({time.perf_counter() - t0:.2f} s)")
        else:
            sequence = rollback_delta(args.url, args.model, token=args.control_token, timeout_s=args.timeout,
                                      ssl=args.ssl, from_sequence=args.from_sequence)
            print(f"sixfold-delta: rolled back; {args.model} serves delta sequence {sequence}")
    except DeltaError as exc:
        print(f"sixfold-delta: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"sixfold-delta {args.command}: {error_text(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - e.g. the server's refusal, named as it said it
        from tritonclient.utils import InferenceServerException
        if isinstance(exc, InferenceServerException):
            message = " ".join(str(exc.message()).split())
            if exc.status() == "StatusCode.UNAVAILABLE" or "failed to connect" in message or "resolv" in message:
                print(f"sixfold-delta {args.command}: cannot reach a server at {args.url} ({message}); give "
                      "--url HOST:PORT of sixfold-serve's gRPC port", file=sys.stderr)
            else:
                print(f"sixfold-delta: the server refused: {message}", file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
