"""Registries that take Bearer tokens (GHCR, Docker Hub, Harbor, GitLab, ...): the real
`docker-registry` configured with `auth: token`, in front of the token service of
token_server.py, which signs a JWT per request and grants each user only its repositories.

What differs from Basic auth, and is checked here: a token is asked for per set of scopes, with
a user name and password or with an identity token from Docker's config file; a blob mount
needs a token that also covers pull on the source repository (the registry names that scope in
its challenge); and a mount the token service will not grant falls back to an upload instead
of failing the push."""

from __future__ import annotations

import hashlib
import json

import pytest
from typer.testing import CliRunner

from qpcbuild.bundle import read_manifest
from qpcbuild.cli import app
from qpcbuild.registry.client import RegistryClient
from qpcbuild.registry.credentials import Credentials
from qpcbuild.tree import hash_tree
from helpers_registry import compile_json, demo_checkout, origins
from registry_server import start_token_registry
from token_server import TokenService

pytestmark = pytest.mark.slow
runner = CliRunner()
PASSWORDS = {"ci": "t0ken-s3cret", "pusher": "push-0nly"}
IDENTITY_TOKEN = "refresh-tok-7f3a"  # what `docker login` stores for OAuth2 registries


def grants(user: str, repo: str) -> set[str]:
    """ci: everything; pusher: its team's repositories only (not the build cache's)."""
    if user == "ci" or repo.startswith("team/"):
        return {"pull", "push"}
    return set()


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("token-registry")
    service = TokenService(root / "tokens", PASSWORDS, grants, {IDENTITY_TOKEN: "ci"})
    server = start_token_registry(root / "registry", service.registry_config())
    yield service, server.address
    server.stop()
    service.stop()


def as_user(user: str) -> dict[str, str]:
    return {"QPCBUILD_REGISTRY_USERNAME": user, "QPCBUILD_REGISTRY_PASSWORD": PASSWORDS[user]}


def test_push_and_pull_with_tokens_from_a_password_and_from_an_identity_token(
        tokens, registry_demo_bundle, tmp_path):
    service, reg = tokens
    ref = f"{reg}/team/tokens:v1"
    pushed = runner.invoke(app, ["push", str(registry_demo_bundle), ref, "--quiet"],
                           env=as_user("ci"))
    assert pushed.exit_code == 0, pushed.output
    assert ("ci", ["repository:team/tokens:pull,push"]) in service.requests
    # Docker's config file as `docker login` leaves it for an OAuth2 registry
    config = tmp_path / "docker"
    config.mkdir()
    (config / "config.json").write_text(json.dumps(
        {"auths": {reg: {"identitytoken": IDENTITY_TOKEN}}}))
    pulled = runner.invoke(app, ["pull", ref, "-d", str(tmp_path / "pulled"), "--json"],
                           env={"DOCKER_CONFIG": str(config), "QPCBUILD_REGISTRY_USERNAME": "",
                                "QPCBUILD_REGISTRY_PASSWORD": ""})
    assert pulled.exit_code == 0, pulled.output
    assert json.loads(pulled.stdout)["digest"] == pushed.stdout.strip()
    assert hash_tree(tmp_path / "pulled") == hash_tree(registry_demo_bundle)


def test_a_wrong_password_is_refused_by_the_token_service_with_a_clear_error(
        tokens, registry_demo_bundle):
    service, reg = tokens
    refused = len(service.refused)
    result = runner.invoke(app, ["push", str(registry_demo_bundle), f"{reg}/team/x:v1"],
                           env={"QPCBUILD_REGISTRY_USERNAME": "ci",
                                "QPCBUILD_REGISTRY_PASSWORD": "not-the-pass"})
    assert result.exit_code == 2, result.output
    assert f"registry {reg} refused a token as ci" in result.output
    assert "not-the-pass" not in result.output and "Traceback" not in result.output
    assert service.refused[refused:] and set(service.refused[refused:]) == {"bad credentials"}


def test_compile_push_mounts_the_remote_cache_with_one_token_for_both_repositories(
        tokens, tmp_path, monkeypatch):
    """The second runner's artifacts are mounted from ci/cache into team/demo: the token it
    asked for covered push on the bundle's repository and pull on the cache's."""
    service, reg = tokens
    monkeypatch.chdir(tmp_path)
    for key, value in as_user("ci").items():
        monkeypatch.setenv(key, value)
    recipe = demo_checkout(tmp_path / "checkout")
    seed, _ = compile_json(recipe, tmp_path / "seed", tmp_path / "cache-a",
                           "--remote-cache", f"{reg}/ci/cache")
    result = runner.invoke(app, ["compile", str(recipe), "--cache-dir", str(tmp_path / "cache-b"),
                                 "--push", f"{reg}/team/demo:v1", "--remote-cache",
                                 f"{reg}/ci/cache", "--json"])
    assert result.exit_code == 0, result.output
    done = json.loads(result.stdout)
    assert set(origins(done).values()) == {"remote"}
    graphs = sum(f.size for p, f in read_manifest(tmp_path / "seed").files.items()
                 if "/ort/" in p)
    assert done["pushed"]["bytes"] > graphs > 20 * done["pushed"]["transferred_bytes"]
    assert ("ci", ["repository:team/demo:pull,push", "repository:ci/cache:pull"]) \
        in service.requests
    pulled = runner.invoke(app, ["pull", done["pushed"]["pinned"], "-d", str(tmp_path / "p"),
                                 "--json"])
    assert pulled.exit_code == 0, pulled.output
    assert json.loads(pulled.stdout)["bundle_id"] == seed["bundle_id"]


def test_a_mount_the_token_service_will_not_grant_becomes_an_upload(tokens):
    service, reg = tokens
    blob = b"a blob only the build cache's repository holds" * 100
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    with RegistryClient(reg, credentials=Credentials("ci", PASSWORDS["ci"], source="test")) as ci:
        assert ci.push_blob("ci/only", digest, len(blob), data=blob)
        assert ci.mount_blob("team/mounted", digest, "ci/only")  # allowed: nothing uploaded
    with RegistryClient(reg, credentials=Credentials("pusher", PASSWORDS["pusher"],
                                                     source="test")) as pusher:
        assert not pusher.mount_blob("team/copied", digest, "ci/only")
        assert ("pusher", ["repository:team/copied:pull,push", "repository:ci/only:pull"]) \
            in service.requests  # asked, and granted only its own repository
        assert not pusher.has_blob("team/copied", digest)
        assert pusher.push_blob("team/copied", digest, len(blob), data=blob)  # bytes sent
        assert pusher.has_blob("team/copied", digest)
