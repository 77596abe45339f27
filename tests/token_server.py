"""A token service for registry tests: what GHCR, Docker Hub, Harbor and GitLab put in front of
a registry. `docker-registry` configured with `auth: token` answers 401 with a Bearer
challenge naming this service's realm; a client asks the realm for a token for the scopes it
needs, with its user name and password (GET) or an identity token (POST, grant_type
refresh_token), and the registry checks the token's signature against this service's
certificate and its `access` claim against each request.

The tokens are JWTs signed RS256 with the certificate in their `x5c` header, which is how the
distribution server's token verifier expects them. Each user is granted, per repository,
only the actions its `grants` allow; every request for a token is recorded (user, scopes) so
a test can see what a client asked for."""

from __future__ import annotations

import base64
import datetime
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs, urlparse

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

ISSUER, SERVICE = "qpcbuild-test-issuer", "qpcbuild-test-registry"
# (user, repository) -> the actions that user may take there
Grants = Callable[[str, str], set[str]]


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenService:
    def __init__(self, root: Path, passwords: dict[str, str], grants: Grants,
                 identity_tokens: dict[str, str] | None = None):
        self.passwords, self.grants = passwords, grants
        self.identity_tokens = identity_tokens or {}  # refresh token -> user
        self.requests: list[tuple[str, list[str]]] = []  # (user, scopes) of every token given
        self.refused: list[str] = []  # why each refused request was refused
        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "qpcbuild test tokens")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self._key, hashes.SHA256()))
        root.mkdir(parents=True, exist_ok=True)
        self.cert_path = root / "token-signer.pem"
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self._x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/token"

    def registry_config(self) -> str:
        """The `auth:` section of the registry's config that sends clients here."""
        return (f"auth:\n  token:\n    realm: {self.realm}\n    service: {SERVICE}\n"
                f"    issuer: {ISSUER}\n    rootcertbundle: {self.cert_path}\n")

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------ tokens
    def _token(self, user: str, scopes: list[str]) -> str:
        access = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            repo, _, actions = rest.rpartition(":")
            allowed = sorted(set(actions.split(",")) & self.grants(user, repo))
            if kind == "repository" and allowed:
                access.append({"type": kind, "name": repo, "actions": allowed})
        now = int(time.time())
        claims = {"iss": ISSUER, "sub": user, "aud": SERVICE, "exp": now + 300,
                  "nbf": now - 10, "iat": now, "jti": uuid.uuid4().hex, "access": access}
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self._x5c]}
        signed = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = self._key.sign(signed.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signed}.{_b64url(signature)}"

    def _who(self, authorization: str | None, form: dict[str, list[str]]) -> str | None:
        """The user a token request authenticates as, or None."""
        if form.get("grant_type") == ["refresh_token"]:
            return self.identity_tokens.get((form.get("refresh_token") or [""])[0])
        if not authorization or not authorization.startswith("Basic "):
            return None
        user, _, password = base64.b64decode(authorization[6:]).decode().partition(":")
        return user if self.passwords.get(user) == password else None

    def _handler(self):
        service = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, form: dict[str, list[str]], scopes: list[str]) -> None:
                user = service._who(self.headers.get("Authorization"), form)
                if user is None or form.get("service") != [SERVICE]:
                    service.refused.append("bad credentials" if user is None else "service")
                    self._send(401, {"errors": [{"code": "UNAUTHORIZED"}]})
                    return
                service.requests.append((user, scopes))
                token = service._token(user, scopes)
                self._send(200, {"token": token, "access_token": token, "expires_in": 300})

            def do_GET(self) -> None:  # http.server's name for it
                form = parse_qs(urlparse(self.path).query)
                self._answer(form, form.get("scope", []))

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                form = parse_qs(self.rfile.read(length).decode())
                # OAuth2's form: one `scope` field, its scopes separated by spaces
                self._answer(form, " ".join(form.get("scope", [])).split())

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # quiet: pytest shows failures, not traffic
                pass

        return Handler
