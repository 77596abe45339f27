"""A registry that answers nonsense, a reference with a password in it, and pull destinations
that cannot hold a bundle. What a registry sends is bounded (size, depth) and checked by model;
each case ends in one clear error naming the problem, exit 1 for a registry's nonsense and 2
for the user's input, with nothing written and no password echoed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpcbuild.cli import app
from qpcbuild.registry.bundles import fetch_signatures
from qpcbuild.registry.client import RegistryClient
from qpcbuild.registry.errors import RegistryError

from hostile_registry import HostileRegistry, endless

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
ARTIFACT = "application/vnd.qpcbuild.bundle.v1"
DIGEST = "sha256:" + "ab" * 32


def cli(*argv):
    return runner.invoke(app, [str(a) for a in argv])


@pytest.fixture(scope="module")
def registry():
    server = HostileRegistry()
    yield server
    server.stop()


def nested(depth: int) -> bytes:
    return b'{"schemaVersion": 2, "layers": ' + b"[" * depth + b"]" * depth + b"}"


def manifest_with(**fields) -> bytes:
    m = {"schemaVersion": 2, "artifactType": ARTIFACT,
         "config": {"mediaType": ARTIFACT, "digest": DIGEST, "size": 2}, "layers": []}
    return json.dumps({**m, **fields}).encode()


@pytest.mark.parametrize("body,says", [
    (b"[1, 2]", "is an array, not a JSON object"),
    (b'"a manifest"', "is a string, not a JSON object"),
    (b"null", "is null, not a JSON object"),
    (b"{not json", "is not JSON"),
    (nested(2_000), "nested too deep"),
    (nested(100_000), "nested too deep"),
    (b'{"schemaVersion": ' + b"9" * 5_000 + b"}", "is not JSON"),
    (manifest_with(annotations=["a", "list"]), "field annotations"),
    (manifest_with(layers={"a": 1}), "field layers"),
    (manifest_with(layers=[{"digest": DIGEST, "size": "12"}]), "field layers.0.size"),
    (endless, "the registry sent more than 4,194,304 bytes"),
], ids=["list", "string", "null", "not-json", "nested-2000", "nested-100000", "long-number",
        "annotations-list", "layers-object", "size-string", "endless"])
def test_a_hostile_manifest_is_refused_naming_it(registry, tmp_path, body, says):
    registry.manifests["v1"] = body
    result = cli("pull", f"{registry.address}/demo/x:v1", "-d", tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert f"the manifest of {registry.address}/demo/x:v1" in result.output and \
        says in result.output, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception,
                                                                     SystemExit)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.parametrize("token,says", [
    (b"<html>token service</html>", "is not JSON"),
    (b'["a", "token"]', "is an array, not a JSON object"),
    (b'{"token": ["not", "a", "string"]}', "field token"),
    (endless, "more than 1,048,576 bytes"),
])
def test_a_token_reply_that_is_not_a_token_is_refused(tmp_path, token, says):
    server = HostileRegistry()
    server.token = token
    try:
        result = cli("pull", f"{server.address}/demo/x:v1", "-d", tmp_path / "out")
    finally:
        server.stop()
    assert result.exit_code == 1 and "the token service's reply" in result.output and \
        says in result.output, result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("index,says", [
    (nested(2_000), "nested too deep"),
    (b'{"schemaVersion": 2, "manifests": {"a": 1}}', "field manifests"),
    (b"[]", "is an array"),
    (endless, "more than 4,194,304 bytes"),
])
def test_a_hostile_referrers_index_is_refused_or_passed_over(registry, index, says):
    registry.referrers[DIGEST] = index
    with RegistryClient(registry.address) as client:
        with pytest.raises(RegistryError, match=says):
            fetch_signatures(client, "demo/x", DIGEST, "demo/x", strict=True)
        notes: list[str] = []
        assert fetch_signatures(client, "demo/x", DIGEST, "demo/x", notes.append,
                                strict=False) == []
        assert len(notes) == 1 and says in notes[0], notes


# ---------------------------------------------------------------- secrets in references
SECRET = "pa55-w0rd-never-shown"


def test_a_password_written_into_a_reference_is_never_echoed(registry, tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    with_password = f"user:{SECRET}@{registry.address}/demo/x"
    for argv in (["pull", f"{with_password}:v1", "-d", tmp_path / "out"],
                 ["pull", f"https://{with_password}:v1"],
                 ["pull", f"{registry.address}/demo/x:v1@{SECRET}"],
                 ["push", bundle, f"{with_password}:v1", "--json"],
                 ["verify", with_password],
                 ["pull", f"user:{SECRET}@registry-without-a-dot/demo/x"],
                 ["verify", f"user:{SECRET}@registry-without-a-dot/demo/x"],
                 ["run", f"{with_password}:v1", "--prompt", "x"],
                 ["compile", ROOT / "recipes" / "demo-ngram.yaml", "--push", f"{with_password}:v1"],
                 ["compile", ROOT / "recipes" / "demo-ngram.yaml", "-o", tmp_path / "o",
                  "--remote-cache", with_password]):
        result = cli(*argv)
        assert result.exit_code == 2, (argv, result.output)
        assert SECRET not in result.output, (argv, result.output)
        assert "***@" in result.output or "after '@'" in result.output, result.output
    assert json.loads(cli("push", bundle, f"{with_password}:v1", "--json").stdout)["error"]


# ---------------------------------------------------------------- pull destinations
def test_a_pull_destination_that_cannot_hold_a_bundle_is_refused_before_downloading(
        registry, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me\n")
    registry.manifests["v1"] = b"[]"  # reached only if the destination were not checked first
    for dest, says in ((Path("/proc/x"), "cannot"), (Path("/dev/null/x"), "cannot create"),
                       (a_file / "x", "cannot create"), (a_file / "sub" / "x", "cannot create"),
                       (a_file, "exists and is not a qpcbuild bundle")):
        result = cli("pull", f"{registry.address}/demo/x:v1", "-d", dest)
        assert result.exit_code == 2, (dest, result.output)
        assert f"-d {dest}: {says}" in result.output, (dest, result.output)
    assert a_file.read_text() == "keep me\n"
