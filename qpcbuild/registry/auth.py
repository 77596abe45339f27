"""How the registry client proves who it is, as registries expect: a 401's challenge answered
with Basic credentials, or with a Bearer token from the realm it names (Docker's token GET with
user name and password, or OAuth2's refresh-token POST with an identity token). Tokens are
kept per set of scopes; credentials come from credentials.py and never reach a log."""

from __future__ import annotations

import base64
import re

import httpx

from .credentials import Credentials, find_credentials
from .documents import MAX_TOKEN_BYTES, TokenReply, parse, read_bounded
from .errors import RegistryAuthError, RegistryError, transport_error

_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')


class Authentication:
    """The client's half that answers challenges (client.RegistryClient is built on it); it
    needs the client's `registry` and `http`."""

    registry: str
    http: httpx.Client

    def start_auth(self, credentials: Credentials | None) -> None:
        self._credentials = credentials
        self._looked_up = credentials is not None
        self._tokens: dict[str, str] = {}  # scopes -> bearer token
        self._basic: str | None = None

    @property
    def credentials(self) -> Credentials | None:
        if not self._looked_up:
            self._credentials, self._looked_up = find_credentials(self.registry), True
        return self._credentials

    def auth_header(self, scope: str) -> dict[str, str]:
        if scope in self._tokens:
            return {"Authorization": f"Bearer {self._tokens[scope]}"}
        return {"Authorization": self._basic} if self._basic else {}

    def _who(self) -> str:
        c = self.credentials
        if c is None:
            return "without credentials (none found in the environment or Docker config)"
        return f"as {c.username or 'an identity token'} (from {c.source})"

    def authenticate(self, challenge: str, scope: str) -> None:
        """Answer a 401's WWW-Authenticate: Basic with the credentials, Bearer with a token.
        `scope` holds the scopes the request needs, separated by spaces; the token is asked
        for those and for any the challenge names (a blob mount needs pull on its source
        repository too, and the registry says so in the challenge)."""
        scheme = challenge.split(" ", 1)[0].lower()
        params = dict(_CHALLENGE_PARAM.findall(challenge))
        creds = self.credentials
        if scheme == "basic":
            if creds is None or creds.username is None:
                raise RegistryAuthError(f"registry {self.registry} needs a user name and "
                                        f"password; none were found ({self._who()})")
            pair = f"{creds.username}:{creds.password}".encode()
            self._basic = "Basic " + base64.b64encode(pair).decode()
            return
        if scheme != "bearer" or "realm" not in params:
            raise RegistryError(f"registry {self.registry}: unsupported authentication "
                                f"challenge '{scheme}'")
        scopes = merged_scopes(scope.split() + params.get("scope", "").split())
        service = params.get("service", self.registry)
        what = f"registry {self.registry}: the token service's reply"
        try:
            if creds and creds.identity_token:  # OAuth2: one form field, scopes space-separated
                request = self.http.build_request("POST", params["realm"], data={
                    "service": service, "scope": " ".join(scopes),
                    "grant_type": "refresh_token", "client_id": "qpcbuild",
                    "refresh_token": creds.identity_token})
            else:  # Docker's token GET: one `scope` parameter per scope
                request = self.http.build_request("GET", params["realm"], params=[
                    ("service", service), *(("scope", s) for s in scopes)])
            auth = (creds.username, creds.password or "") \
                if creds and creds.username and not creds.identity_token else None
            resp = self.http.send(request, auth=auth, stream=True)
            try:
                if resp.status_code in (401, 403):
                    raise RegistryAuthError(f"registry {self.registry} refused a token "
                                            f"{self._who()}")
                if resp.status_code != 200:
                    raise RegistryError(f"registry {self.registry}: token service answered "
                                        f"HTTP {resp.status_code}")
                body = read_bounded(resp.iter_bytes(), MAX_TOKEN_BYTES, what)
            finally:
                resp.close()
        except httpx.HTTPError as exc:
            raise transport_error(self.registry, exc) from None
        self._tokens[scope] = parse(body, TokenReply, what).bearer


def merged_scopes(scopes: list[str]) -> list[str]:
    """One scope per resource, with the union of the actions asked for it, in first-seen
    order: ["repository:a:pull,push", "repository:b:pull", "repository:a:pull"] gives
    ["repository:a:pull,push", "repository:b:pull"]."""
    actions: dict[str, dict[str, None]] = {}
    for scope in scopes:
        resource, _, wanted = scope.rpartition(":")
        actions.setdefault(resource, {}).update(dict.fromkeys(wanted.split(",")))
    return [f"{resource}:{','.join(acts)}" for resource, acts in actions.items()]
