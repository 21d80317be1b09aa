"""The image's HEALTHCHECK: is the sixfold-serve in this container ready, on the port and scheme it serves?

    python /opt/sixfold/docker/healthcheck.py                    # the server's own flags, from /proc
    python docker/healthcheck.py --http-port 9000 --tls-cert c.pem  # or name them (tests, other hosts)

Docker runs a health check as a separate process, so it cannot see the ENTRYPOINT's arguments
unless it reads them: this script finds the ``sixfold-serve`` process in the container (PID 1 when
the ENTRYPOINT runs it directly; any PID under ``--init``), reads its command line from
``/proc/PID/cmdline`` (ENTRYPOINT and CMD, or the arguments given to ``docker run``: the last
``--http-port`` wins, as in the server) and asks what the server answers on:

- ``--http-port P`` (default 8000): ``GET /v2/health/ready`` on P, over HTTPS when ``--tls-cert`` is
  given (the certificate is not checked: the probe asks its own container over loopback, and the
  certificate names the public host). Healthy = 200; 400 while loading or draining.
- ``--http-port -1`` (no REST): the ``grpc.health.v1`` service on ``--grpc-port`` (default 8001),
  over TLS when ``--tls-cert`` is given (trusting that certificate, with the name it carries).
- ``--host A``: asks A; ``0.0.0.0`` / ``::`` (every interface) is asked on loopback.

Standard library only (plus grpcio, which the server itself needs, for the REST-less case), so the
slim image needs no curl. Exit status: 0 healthy, 1 unhealthy (one line says why), as Docker wants.
A port of 0 (``--http-port 0``: a free port picked at start) cannot be known from outside: unhealthy.
"""

from __future__ import annotations

import argparse
import http.client
import os
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

READY_PATH = "/v2/health/ready"
"""What Docker's HEALTHCHECK asks, as the Kubernetes readiness probe does (docker/k8s/deployment.yaml)."""
SERVER = "sixfold-serve"
DEFAULTS = {"host": "127.0.0.1", "http_port": 8000, "grpc_port": 8001}
"""sixfold-serve's own defaults for the flags this probe reads (sixfold.server.cli)."""
TIMEOUT_S = 2.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]  # NOTE: exit 1 (unhealthy), never argparse's 2
        raise ValueError(f"the server's flags: {message}")


def _parser() -> argparse.ArgumentParser:
    # NOTE: the server's flags this probe needs, with the server's defaults; any other flag is ignored.
    # allow_abbrev=False: a prefix of one of these may be another flag of the server's.
    p = _Parser(add_help=False, allow_abbrev=False)
    p.add_argument("--host", default=DEFAULTS["host"])
    p.add_argument("--http-port", type=int, default=DEFAULTS["http_port"])
    p.add_argument("--grpc-port", type=int, default=DEFAULTS["grpc_port"])
    p.add_argument("--tls-cert", default=None)
    return p


def server_flags(argv: list[str], cwd: str | os.PathLike[str] = ".") -> argparse.Namespace:
    """The flags of a sixfold-serve command line (program name excluded); a relative --tls-cert
    is taken from ``cwd``, the server's working directory."""
    args, _ = _parser().parse_known_args(argv)
    if args.tls_cert:
        args.tls_cert = str(Path(cwd) / args.tls_cert)
    return args


def _cmdline(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [part.decode("utf-8", "surrogateescape") for part in raw.split(b"\0") if part]


def _server_args(words: list[str]) -> list[str] | None:
    """The arguments after the ``sixfold-serve`` program (run directly, or as ``python .../sixfold-serve``);
    None for another program, or for the engine sixfold-serve --workers starts itself (``--as-engine``)."""
    for k, word in enumerate(words[:2]):
        if Path(word).name == SERVER:
            rest = words[k + 1:]
            return None if any(w == "--as-engine" or w.startswith("--as-engine=") for w in rest) else rest
    return None


def find_server(pid: int | None = None) -> tuple[list[str], str]:
    """(arguments, working directory) of the sixfold-serve process: ``pid``, else the lowest PID
    running sixfold-serve. Raises LookupError when there is none."""
    pids = [pid] if pid is not None else sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
    for candidate in pids:
        try:
            args = _server_args(_cmdline(candidate))
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if args is not None:
            try:
                return args, os.readlink(f"/proc/{candidate}/cwd")
            except OSError:  # NOTE: a hardened kernel may hide it; the image runs both in its WORKDIR
                return args, os.getcwd()
    raise LookupError(f"no {SERVER} process" + (f" with PID {pid}" if pid is not None else " in this container"))


def _loopback(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host)


def _http_ready(host: str, port: int, tls: bool) -> tuple[bool, str]:
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    url = f"{'https' if tls else 'http'}://{netloc}{READY_PATH}"
    context = None
    if tls:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as answer:
            return answer.status == 200, f"{url}: {answer.status}"
    except urllib.error.HTTPError as err:
        return False, f"{url}: {err.code} (not ready: loading or draining)"
    except (OSError, ValueError) as err:  # refused, timed out, not TLS
        return False, f"{url}: {getattr(err, 'reason', err)}"
    except http.client.HTTPException as err:  # something else answers there (a gRPC port: HTTP/2 only)
        return False, f"{url}: not an HTTP/1.1 answer ({type(err).__name__})"


def _cert_name(cert: str) -> str | None:
    """A name the certificate carries (its first DNS subjectAltName, else its CN), to check it by."""
    try:
        decoded = ssl._ssl._test_decode_cert(cert)  # type: ignore[attr-defined]  # NOTE: stdlib, no parser
    except (AttributeError, OSError, ssl.SSLError):
        return None
    for kind, value in decoded.get("subjectAltName", ()):
        if kind == "DNS":
            return value
    for rdn in decoded.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return None


def _grpc_ready(host: str, port: int, cert: str | None) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if cert:
        name = _cert_name(cert)
        options = [("grpc.ssl_target_name_override", name)] if name else []
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(Path(cert).read_bytes()), options)
    else:
        channel = grpc.insecure_channel(target)
    try:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                           timeout=TIMEOUT_S).status
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        return status == health_pb2.HealthCheckResponse.SERVING, f"grpc.health.v1 at {target}: {name}"
    except grpc.RpcError as err:
        return False, f"grpc.health.v1 at {target}: {err.code().name}"
    finally:
        channel.close()


def probe(args: argparse.Namespace) -> tuple[bool, str]:
    """(healthy, what was asked and answered) for a server started with ``args``."""
    host = _loopback(args.host)
    if args.http_port == 0 or (args.http_port < 0 and args.grpc_port == 0):
        return False, "the server picks its port at start (port 0): give it a fixed one to health-check it"
    if args.http_port > 0:
        return _http_ready(host, args.http_port, bool(args.tls_cert))
    return _grpc_ready(host, args.grpc_port, args.tls_cert)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] == "--pid":
            server_argv, cwd = find_server(int(argv[1]))
        elif argv:
            server_argv, cwd = argv, os.getcwd()
        else:
            server_argv, cwd = find_server()
        healthy, said = probe(server_flags(server_argv, cwd))
    except Exception as err:  # noqa: BLE001 - whatever went wrong, Docker gets 1 (unhealthy), not a traceback
        healthy, said = False, f"{type(err).__name__}: {err}"
    print(("healthy: " if healthy else "unhealthy: ") + said)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
