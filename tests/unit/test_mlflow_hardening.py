"""MLflow access fails closed, fast and quietly: model names checked before any filter, a
malformed champion lookup is an error (not "no champion"), credentials in the tracking URI
never reach a message or summary.json, and one deadline bounds a step against a server
that does not answer (no MLflow retries stacked under ours).

The servers here are stand-ins (named as such): a socket that accepts and never answers,
and an HTTP server that answers every request with one MLflow error. The real-server
behaviour is in tests/components/test_register.py.
"""

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import mlflow
import pytest
from mlflow.exceptions import MlflowException

from components.mlflow_access import (
    RegistryUnavailable,
    RetryPolicy,
    call_with_retries,
    check_model_name,
    redact_credentials,
)
from components.register_model.register import register_checkpoint
from components.validate_checkpoint.champion import load_champion
from rtp_support.embedded_s3 import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def point_at(monkeypatch):
    def point(url: str) -> None:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        mlflow.set_tracking_uri(url)

    yield point
    mlflow.set_tracking_uri(None)


class SilentServer:
    """Stand-in for an MLflow server that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


class OneErrorServer:
    """Stand-in for an MLflow server that answers every request with one MLflow error."""

    def __init__(self, status: int, code: str) -> None:
        payload = json.dumps({"error_code": code, "message": f"{code}: stand-in answer"}).encode()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["a' or name != 'b", "x`y", "nightly\n", "", "../x", 'q"'])
def test_bad_model_names_are_refused_before_any_server_call(name, point_at, tmp_path):
    point_at(f"http://127.0.0.1:{free_port()}")  # nothing listens: a call would fail differently
    with pytest.raises(ValueError, match="model name"):
        check_model_name(name)
    with pytest.raises(ValueError, match="model name"):
        register_checkpoint(str(tmp_path / "step_1"), name, "champion", retry=RetryPolicy(1))
    with pytest.raises(ValueError, match="model name"):
        load_champion(name, RetryPolicy(1))


# ---------------------------------------------------------------- champion lookup fails closed


def test_a_malformed_champion_lookup_is_an_error_not_no_champion(point_at):
    server = OneErrorServer(400, "INVALID_PARAMETER_VALUE")
    try:
        point_at(server.url)
        with pytest.raises(MlflowException, match="INVALID_PARAMETER_VALUE"):
            load_champion("rtp-model", RetryPolicy(1))
    finally:
        server.close()


def test_a_missing_registered_model_means_no_champion(point_at):
    server = OneErrorServer(404, "RESOURCE_DOES_NOT_EXIST")
    try:
        point_at(server.url)
        assert load_champion("rtp-model", RetryPolicy(1)) is None
    finally:
        server.close()


# ---------------------------------------------------------------- credentials


def test_redaction_hides_user_and_password():
    assert (
        redact_credentials("https://alice:s3cret@mlflow.example.com/x") == "https://***@mlflow.example.com/x"
    )
    assert redact_credentials("https://token@h:5000") == "https://***@h:5000"
    assert (
        redact_credentials("API request to http://a:b@h/api failed")
        == "API request to http://***@h/api failed"
    )
    assert redact_credentials("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"
    assert redact_credentials("http://h:5000") == "http://h:5000"


def test_credentials_in_the_tracking_uri_never_reach_an_error(point_at):
    url = f"http://alice:s3cret@127.0.0.1:{free_port()}"  # nothing listens here
    point_at(url)
    client = mlflow.MlflowClient()
    with pytest.raises(RegistryUnavailable) as info:
        call_with_retries(
            "search models", lambda: client.search_registered_models(), RetryPolicy(2, 0.05, 0.05)
        )
    assert "s3cret" not in str(info.value) and "alice" not in str(info.value)
    assert "http://***@127.0.0.1" in str(info.value)


def test_credentials_in_the_tracking_uri_never_reach_summary_json(tmp_path):
    from rtp_cli.local_run import LocalOptions, build_summary

    summary = build_summary(LocalOptions(), tmp_path, "https://alice:s3cret@mlflow.example.com", "demo", 1.0)
    text = json.dumps(summary)
    assert "s3cret" not in text and "alice" not in text
    assert summary["mlflow"]["tracking_uri"] == "https://***@mlflow.example.com"


# ---------------------------------------------------------------- one deadline per step


def test_a_server_that_never_answers_fails_within_the_steps_deadline(point_at, monkeypatch):
    # MLflow's defaults (7 retries with backoff, 120 s per request) are what a user gets.
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    server = SilentServer()
    try:
        point_at(server.url)
        policy = RetryPolicy(attempts=6, first_delay_s=0.1, max_delay_s=0.2, deadline_s=6)
        with pytest.raises(RegistryUnavailable, match=r"deadline of 6 s") as info:
            load_champion("rtp-model", policy)
        assert "MLFLOW_TRACKING_URI" in str(info.value)
        # no retry layer of MLflow's own under ours: one connection per attempt of ours
        assert 1 <= len(server.accepted) <= policy.attempts
    finally:
        server.close()
    # MLflow's settings are ours only while our loop runs
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ


def test_the_cli_never_prints_credentials_in_an_error(monkeypatch, capsys):
    import argparse

    import rtp_cli.main as cli

    def failing(args: argparse.Namespace) -> int:  # stand-in for a command whose error names the URI
        raise ValueError("cannot reach https://alice:s3cret@mlflow.example.com/api")

    parser = argparse.ArgumentParser()
    parser.set_defaults(handler=failing, command="register", verbose=False)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err == "rtp register: error: cannot reach https://***@mlflow.example.com/api\n"


# ---------------------------------------------------------------- secrets written with an editor


class LoginRecordingServer:
    """Stand-in for an MLflow server that records each request's Authorization header and
    answers every search with an empty list."""

    def __init__(self) -> None:
        self.logins: list[str] = []
        logins = self.logins
        payload = json.dumps({"registered_models": []}).encode()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                logins.append(self.headers.get("Authorization", ""))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_secret_values_with_a_trailing_newline_still_reach_the_server_and_log_in(monkeypatch):
    """`kubectl create secret --from-file` keeps the newline an editor leaves at the end of
    each file; the step's MLflow variables then end in one."""
    import base64

    from components.mlflow_access import step_deadline, tracking_uri_is_configured

    server = LoginRecordingServer()
    mlflow.set_tracking_uri(None)  # as in a step's fresh process: the URI comes from the variable
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url + "\n")
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "pipeline\n")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret\r\n")
        assert tracking_uri_is_configured()
        with step_deadline(RetryPolicy(attempts=1, deadline_s=20)):
            found = call_with_retries(
                "search models",
                lambda: mlflow.MlflowClient().search_registered_models(),
                RetryPolicy(attempts=1),
            )
    finally:
        server.close()
        mlflow.set_tracking_uri(None)
    assert list(found) == []
    assert server.logins == ["Basic " + base64.b64encode(b"pipeline:s3cret").decode()]
    assert os.environ["MLFLOW_TRACKING_URI"] == server.url


def test_the_trainer_reads_the_tracking_uri_without_its_line_end(monkeypatch):
    from trainer import env

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.mlflow.svc.cluster.local:5000\n")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret\n")
    assert env.mlflow_tracking_uri() == "http://mlflow.mlflow.svc.cluster.local:5000"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "s3cret"  # mlflow reads it from there
