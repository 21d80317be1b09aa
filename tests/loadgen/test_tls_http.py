"""sixfold-loadgen over TLS (``--ssl``, ``--root-certificates``) and over REST (``--protocol http``),
against real sixfold-serve processes: one serving gRPC and HTTPS with a generated certificate, one
serving plain REST. Every mode: open and closed loop, --find-max-qps, --processes, MLPerf."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from sixfold import models
from sixfold.loadgen.cli import main
from sixfold.loadgen.rest import HTTP_REASONS, RawHttpTransport, TritonHttpTransport, decode_scores, HttpControlClient
from sixfold.loadgen.transport import RawGrpcTransport, RequestFailed
from tests.conftest import ServeProcess, free_port

MODEL = "tiny"


def _serve(*extra: str) -> tuple[ServeProcess, str]:
    """A tiny sixfold-serve; (process, its REST HOST:PORT). Its gRPC HOST:PORT is ``process.url``."""
    http = free_port()
    serve = ServeProcess("--model", MODEL, "--cards", "1", "--grpc-port", "0", "--http-port", str(http),
                         "--metrics-port", "-1", *extra)
    return serve, f"127.0.0.1:{http}"


@pytest.fixture(scope="module")
def tls_server(certificate):
    cert, key = certificate
    serve, rest = _serve("--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert serve.url, serve.output
        assert f"REST https://{rest}/v2" in serve.output
        yield {"grpc": serve.url, "http": rest, "cert": str(cert)}
    finally:
        serve.stop()


@pytest.fixture(scope="module")
def rest_server():
    serve, rest = _serve()
    try:
        assert serve.url, serve.output
        yield rest
    finally:
        serve.stop()


def _run(tmp_path: Path, url: str, *extra: str, qps: str = "40", duration: str = "1") -> tuple[int, dict]:
    path = tmp_path / "report.json"
    path.unlink(missing_ok=True)
    code = main(["--url", url, "--model", MODEL, "--qps", qps, "--duration", duration, "--report", str(path),
                 "--wait-ready", "30", "--quiet", *extra])
    return code, (json.loads(path.read_text()) if path.exists() else {})


def _all_answered(report: dict) -> None:
    req = report["requests"]
    assert req["sent"] == req["ok"] == req["scheduled"] > 0 and req["errors"] == 0, report["errors_by_reason"]


@pytest.mark.parametrize("protocol, client", [("grpc", "raw"), ("grpc", "tritonclient"), ("grpc", "shm"),
                                              ("http", "raw"), ("http", "tritonclient")])
def test_open_loop_over_tls(tls_server, tmp_path, protocol, client):
    code, report = _run(tmp_path, tls_server[protocol], "--protocol", protocol, "--client", client,
                        "--ssl", "--root-certificates", tls_server["cert"])
    assert code == 0
    _all_answered(report)
    assert (report["target"]["protocol"], report["target"]["ssl"]) == (protocol, True)
    assert report["config"]["root_certificates"] == tls_server["cert"]


def test_without_trust_or_without_tls_nothing_is_sent(tls_server, tmp_path, capsys):
    """No --root-certificates: the system's roots do not trust a self-signed server; no --ssl: a TLS port
    does not answer plaintext. Either way exit 1, one line, naming what to check."""
    for protocol, tls in (("grpc", ["--ssl"]), ("grpc", []), ("http", ["--ssl"]), ("http", [])):
        code, report = _run(tmp_path, tls_server[protocol], "--protocol", protocol, "--wait-ready", "1", *tls)
        err = capsys.readouterr().err.strip()
        assert code == 1 and not report, err
        assert "\n" not in err and "Traceback" not in err
        assert err.startswith(f"sixfold-loadgen: error: cannot reach a KServe v2 server at {tls_server[protocol]}")
        if tls:
            assert "certificate verify failed" in err.lower().replace("_", " ") and "--root-certificates" in err
        else:
            assert "add --ssl" in err


def test_every_mode_over_https(tls_server, tmp_path, capsys):
    tls = ["--protocol", "http", "--ssl", "--root-certificates", tls_server["cert"]]
    url = tls_server["http"]
    code, closed = _run(tmp_path, url, *tls, "--concurrency", "2")
    assert code == 0 and closed["mode"] == "closed"
    _all_answered(closed)
    code, spread = _run(tmp_path, url, *tls, "--processes", "2")
    assert code == 0 and spread["target"]["processes"] == 2
    _all_answered(spread)
    capsys.readouterr()
    code, search = _run(tmp_path, url, *tls, "--find-max-qps", "--p99-ms", "500", "--min-qps", "20",
                        "--max-qps", "40", "--step-duration", "1", "--max-steps", "2")
    assert code == 0 and [row["pass"] for row in search["sweep"]] == [True, True]
    assert search["target"]["protocol"] == "http" and search["max_qps_under_slo"] == 40
    # --quiet: no table, but the answer, which is what a search is run for
    assert capsys.readouterr().out.strip() == "max QPS with p99 <= 500 ms: 40.0"


def test_mlperf_over_tls_both_protocols(tls_server, tmp_path, capsys):
    for protocol in ("http", "grpc"):
        logs = tmp_path / protocol
        code = main(["--url", tls_server[protocol], "--model", MODEL, "--protocol", protocol, "--ssl",
                     "--root-certificates", tls_server["cert"], "--mlperf-scenario", "server", "--qps", "20",
                     "--duration", "1", "--mlperf-min-queries", "16", "--mlperf-samples", "16",
                     "--mlperf-warmup-queries", "2", "--mlperf-log-dir", str(logs), "--report", str(logs / "r.json"),
                     "--wait-ready", "30"])
        out = capsys.readouterr().out
        assert code == 0, out
        assert f"@ {tls_server[protocol]}" in out and ("(REST, TLS)" if protocol == "http" else "(TLS)") in out
        result = json.loads((logs / "r.json").read_text())
        assert result["errors"] == 0 and result["samples_sent"] >= 16, result
        assert (result["settings"]["protocol"], result["settings"]["ssl"]) == (protocol, True)


def test_rest_and_grpc_answer_the_same_scores(tls_server):
    """One query through each transport: bit-identical scores (the server batches both alike)."""
    request = models.RequestGenerator.for_config(models.get_config(MODEL), seed=4).make(5)
    tls = {"ssl": True, "root_certificates": tls_server["cert"]}

    async def scores() -> list[bytes]:
        control = HttpControlClient(tls_server["http"], **tls)
        transports = [RawGrpcTransport(tls_server["grpc"], MODEL, **tls),
                      RawHttpTransport(tls_server["http"], MODEL, **tls),
                      TritonHttpTransport(control, MODEL)]
        try:
            out = []
            for transport in transports:
                await transport.connect(10)
                out.append(await transport.infer(transport.prepare(request), 5))
            return out
        finally:
            for transport in transports:
                await transport.close()
            await control.close()

    answers = asyncio.run(scores())
    assert len(answers[0]) == 5 * 4 and answers[0] == answers[1] == answers[2]
    assert np.isfinite(np.frombuffer(answers[0], "<f4")).all()


def test_plain_rest_open_loop_and_its_errors(rest_server, tmp_path, capsys):
    code, report = _run(tmp_path, rest_server, "--protocol", "http", "--client", "raw", "--ids-dtype", "int32")
    assert code == 0
    _all_answered(report)
    assert report["target"]["protocol"] == "http" and report["target"]["ssl"] is False
    assert report["target"]["sources"]["table_rows"] == "server"  # ModelConfig parameters, read over REST
    code, _ = _run(tmp_path, rest_server, "--protocol", "http", "--model", "nope")
    assert code == 1 and "unknown model 'nope'" in capsys.readouterr().err
    # a refusal counts under the gRPC status its HTTP status stands for: 400 (wrong dense width) invalid_argument
    code, refused = _run(tmp_path, rest_server, "--protocol", "http", "--dense-dim", "3", qps="5")
    assert code == 0 and refused["requests"]["ok"] == 0 and refused["requests"]["sent"] > 0
    assert refused["errors_by_reason"] == {HTTP_REASONS[400]: refused["requests"]["sent"]}


@pytest.mark.parametrize("extra, message", [
    (["--root-certificates", "cert.pem"], "--root-certificates needs --ssl"),
    (["--ssl", "--root-certificates", "/no/such.pem"], "--root-certificates '/no/such.pem': no such file"),
    (["--protocol", "http", "--client", "shm"], "--client shm needs --protocol grpc"),
    (["--protocol", "http", "--channels", "2"], "--channels is for gRPC"),
])
def test_bad_connection_flags_exit_2(tmp_path, capsys, extra, message):
    code, _ = _run(tmp_path, "127.0.0.1:1", *extra)
    assert code == 2 and message in capsys.readouterr().err


def test_decode_scores_binary_json_and_wrong():
    values = np.arange(3, dtype="<f4")
    head = json.dumps({"outputs": [{"name": "scores", "datatype": "FP32", "shape": [3, 1],
                                    "parameters": {"binary_data_size": 12}}]}).encode()
    assert decode_scores(head + values.tobytes(), len(head), 3) == values.tobytes()
    as_json = json.dumps({"outputs": [{"name": "scores", "datatype": "FP32", "shape": [3, 1],
                                       "data": values.tolist()}]}).encode()
    assert decode_scores(as_json, None, 3) == values.tobytes()
    with pytest.raises(RequestFailed, match="expected scores \\[4, 1\\]"):
        decode_scores(as_json, None, 4)
    with pytest.raises(RequestFailed) as caught:
        decode_scores(b"<html>", None, 3)
    assert caught.value.reason == "bad_output"
