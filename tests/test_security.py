"""Authentication and transport security: bearer tokens on every service (health stays open),
separate public and internal secrets, TLS and mTLS, and their settings' errors."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specinfer.errors import UserError
from specinfer.serving.security import ChannelSecurity, ServerSecurity, bearer, open_channel
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc
from util import start_stack

INTERNAL = "internal-token-1234"
PUBLIC = "public-token-5678"
WIDTHS = (2, 1, 1)
PROMPT = "def add(a, b):\n"


def _secured(llm: Path, ssm: Path):
    return start_stack(
        llm, [ssm], tree_width=WIDTHS, speculator_step_timeout_s=5,
        server_security=ServerSecurity(token=INTERNAL), speculator_security=ChannelSecurity(token=INTERNAL),
        speculator={"server_security": ServerSecurity(token=INTERNAL)},
        gateway={"server_security": ServerSecurity(token=PUBLIC), "verifier_security": ChannelSecurity(token=INTERNAL)})


@pytest.fixture(scope="module")
def secured(text_pair):
    with _secured(*text_pair) as stack:
        yield stack


def _ports(stack) -> dict[str, tuple[int, str, object]]:
    """service -> (port, its token, a unary call on a stub)."""
    return {
        "gateway": (stack.gateway.port, PUBLIC, lambda ch, **kw: pb_grpc.GatewayStub(ch).Info(pb.InfoRequest(), **kw)),
        "verifier": (stack.verifier.port, INTERNAL,
                     lambda ch, **kw: pb_grpc.VerifierStub(ch).Info(pb.InfoRequest(), **kw)),
        "speculator": (stack.speculators[0][0].port, INTERNAL,
                       lambda ch, **kw: pb_grpc.SpeculatorStub(ch).Info(pb.InfoRequest(), **kw)),
    }


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("service", ["gateway", "verifier", "speculator"])
def test_every_service_refuses_calls_without_its_token(secured, service):
    port, token, info = _ports(secured)[service]
    other = INTERNAL if token == PUBLIC else PUBLIC  # the edge and the internal hops are separate secrets
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        assert _code(lambda: info(ch, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        for wrong in ("nope", other, token + "x"):
            assert _code(lambda: info(ch, timeout=10, metadata=[bearer(wrong)])) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: info(ch, timeout=10, metadata=[("authorization", token)])) == \
            grpc.StatusCode.UNAUTHENTICATED  # no "Bearer " scheme
        assert _code(lambda: info(ch, timeout=10, metadata=[bearer(token)])) == grpc.StatusCode.OK
        # probes need no token; reflection does
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        assert _code(lambda: list(reflect.ServerReflectionInfo(iter([request]), timeout=10))) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert list(reflect.ServerReflectionInfo(iter([request]), timeout=10, metadata=[bearer(token)]))


def test_streams_are_refused_too(secured):
    with grpc.insecure_channel(f"127.0.0.1:{secured.gateway.port}") as ch:
        call = pb_grpc.GatewayStub(ch).GenerateStream(pb.GenerateRequest(prompt=PROMPT, max_tokens=4), timeout=10)
        assert _code(lambda: list(call)) == grpc.StatusCode.UNAUTHENTICATED


def test_greedy_through_the_authenticated_stack_matches_the_open_one(secured, text_pair):
    from specinfer.cli.client import GatewayClient

    with GatewayClient(f"127.0.0.1:{secured.gateway.port}", timeout_s=60, token=PUBLIC) as client:
        got = client.generate(PROMPT, max_tokens=24)
    assert not got.stats.fell_back and got.stats.mean_tree_nodes > 1  # the speculator took the token
    llm, ssm = text_pair
    with start_stack(llm, [ssm], tree_width=WIDTHS, gateway={}) as open_stack:
        with GatewayClient(f"127.0.0.1:{open_stack.gateway.port}", timeout_s=60) as client:
            want = client.generate(PROMPT, max_tokens=24)
    assert got.token_ids == want.token_ids and len(got.token_ids) == 24


def test_cli_client_sends_its_token(secured, monkeypatch, capsys):
    from specinfer.cli.main import main

    target = f"127.0.0.1:{secured.gateway.port}"
    monkeypatch.delenv("SPECINFER_GATEWAY_TOKEN", raising=False)
    assert main(["client", "info", "--target", target]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(["client", "info", "--target", target, "--token", PUBLIC]) == 0
    monkeypatch.setenv("SPECINFER_GATEWAY_TOKEN", PUBLIC)
    assert main(["client", "info", "--target", target]) == 0


# ---- TLS ---------------------------------------------------------------------------------------
def _certs(root: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject, key, issuer, issuer_key, *, is_ca=False, san=None):
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def write(stem, key, crt):
        (root / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                             serialization.PrivateFormat.PKCS8,
                                                             serialization.NoEncryption()))
        (root / f"{stem}.pem").write_bytes(crt.public_bytes(serialization.Encoding.PEM))

    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    write("ca", ca_key, cert("test-ca", ca_key, "test-ca", ca_key, is_ca=True))
    write("server", server_key, cert("server", server_key, "test-ca", ca_key, san=[
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]))
    write("client", client_key, cert("client", client_key, "test-ca", ca_key))
    return {stem: root / f"{stem}.pem" for stem in ("ca", "server", "client")} | \
        {f"{stem}_key": root / f"{stem}.key" for stem in ("ca", "server", "client")}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return _certs(tmp_path_factory.mktemp("certs"))


def _serve(security: ServerSecurity):
    from specinfer.serving.grpc_server import ServerConfig, start_server

    return start_server(ServerConfig(port=0, grace_s=0, security=security), [], ["test.Secure"])


def _health(channel: grpc.Channel) -> grpc.StatusCode:
    stub = health_pb2_grpc.HealthStub(channel)
    return _code(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=5))


def test_tls_channel_works_and_plaintext_fails(certs, monkeypatch):
    from specinfer.serving.healthcheck import check

    server = _serve(ServerSecurity(tls_cert=certs["server"], tls_key=certs["server_key"]))
    target = f"127.0.0.1:{server.port}"
    try:
        with open_channel(target, ChannelSecurity(tls_ca=certs["ca"])) as ch:
            assert _health(ch) == grpc.StatusCode.OK
        with grpc.insecure_channel(target) as ch:
            assert _health(ch) == grpc.StatusCode.UNAVAILABLE
        monkeypatch.delenv("SPECINFER_TLS_CA", raising=False)
        assert not check(target, timeout_s=5)[0]
        monkeypatch.setenv("SPECINFER_TLS_CA", str(certs["ca"]))
        assert check(target, timeout_s=5) == (True, "SERVING")  # the container probe speaks TLS too
    finally:
        server.stop(0)


def test_mtls_refuses_a_client_without_a_certificate(certs):
    server = _serve(ServerSecurity(tls_cert=certs["server"], tls_key=certs["server_key"], tls_client_ca=certs["ca"]))
    target = f"127.0.0.1:{server.port}"
    try:
        with open_channel(target, ChannelSecurity(tls_ca=certs["ca"])) as ch:
            assert _health(ch) == grpc.StatusCode.UNAVAILABLE
        with open_channel(target, ChannelSecurity(tls_ca=certs["ca"], tls_cert=certs["client"],
                                                  tls_key=certs["client_key"])) as ch:
            assert _health(ch) == grpc.StatusCode.OK
    finally:
        server.stop(0)


def test_tls_and_token_together(certs):
    server = _serve(ServerSecurity(token=INTERNAL, tls_cert=certs["server"], tls_key=certs["server_key"]))
    target = f"127.0.0.1:{server.port}"
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    try:
        for token, want in ((INTERNAL, grpc.StatusCode.OK), (None, grpc.StatusCode.UNAUTHENTICATED)):
            with open_channel(target, ChannelSecurity(token=token, tls_ca=certs["ca"])) as ch:
                stub = reflection_pb2_grpc.ServerReflectionStub(ch)
                assert _code(lambda: list(stub.ServerReflectionInfo(iter([request]), timeout=5))) == want
    finally:
        server.stop(0)


# ---- settings ----------------------------------------------------------------------------------
def test_tokens_come_from_files_or_the_environment_and_stay_separate(tmp_path):
    from services.gateway.config import config_from_args
    from services.speculator.config import parse_config as speculator_config
    from services.verifier.config import parse_config as verifier_config

    secret = tmp_path / "token"
    secret.write_text(INTERNAL + "\n")
    v = verifier_config(["--model", str(tmp_path)], {"SPECINFER_AUTH_TOKEN_FILE": str(secret)})
    assert v.server_security.token == INTERNAL and v.speculator_security.token == INTERNAL
    assert INTERNAL not in repr(v)
    s = speculator_config(["--ssm", str(tmp_path), "--auth-token-file", str(secret)], {})
    assert s.server_security.token == INTERNAL
    g = config_from_args(["--model-dir", str(tmp_path)], {"SPECINFER_AUTH_TOKEN": INTERNAL,
                                                          "SPECINFER_GATEWAY_AUTH_TOKEN": PUBLIC})
    assert g.server_security.token == PUBLIC and g.verifier_security.token == INTERNAL
    g = config_from_args(["--model-dir", str(tmp_path)], {"SPECINFER_AUTH_TOKEN": INTERNAL})
    assert g.server_security.token is None and g.verifier_security.token == INTERNAL
    assert speculator_config(["--ssm", str(tmp_path)], {}).server_security == ServerSecurity()


def test_bad_security_settings_are_clear_errors(tmp_path):
    from services.gateway.config import config_from_args
    from services.speculator.config import parse_config as speculator_config

    empty = tmp_path / "empty"
    empty.write_text("\n")
    cert = tmp_path / "cert.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    cases = [
        (["--auth-token-file", str(tmp_path / "missing")], {}, "no such file"),
        (["--auth-token-file", str(empty)], {}, "is empty"),
        (["--auth-token-file", str(tmp_path)], {}, "is a directory"),
        ([], {"SPECINFER_AUTH_TOKEN": "has space"}, "SPECINFER_AUTH_TOKEN"),
        (["--tls-cert", str(cert)], {}, "--tls-key"),
        (["--tls-cert", str(cert), "--tls-key", str(tmp_path / "nokey")], {}, "--tls-key"),
        (["--tls-client-ca", str(cert)], {}, "--tls-client-ca"),
    ]
    for argv, env, needle in cases:
        with pytest.raises(UserError, match=needle):
            speculator_config(["--ssm", str(tmp_path), *argv], env)
    with pytest.raises(UserError, match="--internal-token-file"):
        config_from_args(["--model-dir", str(tmp_path), "--internal-token-file", str(tmp_path / "x")], {})
    with pytest.raises(UserError, match="--tls-ca"):
        config_from_args(["--model-dir", str(tmp_path), "--tls-client-cert", str(cert),
                          "--tls-client-key", str(cert)], {})


def test_local_stack_gets_a_fresh_internal_token_in_the_environment(monkeypatch):
    from specinfer.cli.launcher import Stack, StackConfig

    spawned = []
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, module, args, port, env: spawned.append((args, env)))
    Stack(StackConfig(llm=Path("/m/llm"), ssms=(Path("/m/a"),))).start()
    Stack(StackConfig(llm=Path("/m/llm"), ssms=(Path("/m/a"),))).start()
    first, second = spawned[:3], spawned[3:]
    tokens = {env["SPECINFER_AUTH_TOKEN"] for _, env in first}
    assert len(tokens) == 1 and len(next(iter(tokens))) >= 32  # every child of one stack shares it
    assert second[0][1]["SPECINFER_AUTH_TOKEN"] not in tokens  # a new one per stack
    assert not any(token in " ".join(args) for args, _ in spawned for token in tokens)  # never on a command line
