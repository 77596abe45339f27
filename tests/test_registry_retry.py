"""Reads repeated on transient registry errors, uploads never: the client against a scripted
HTTP transport (the real registry's 500s under concurrent pushes are what this guards against;
tests/test_examples.py's parallel builders met one)."""

from __future__ import annotations

import httpx
import pytest

from qpcbuild.registry.client import RegistryClient
from qpcbuild.registry.errors import RegistryError, RegistryUnavailable

DIGEST = "sha256:" + "ab" * 32


def scripted(statuses: list[int], headers: dict | None = None):
    """A client whose registry answers `statuses` in turn (the last one from then on), and
    the list of requests it saw."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        status = statuses[min(len(seen), len(statuses)) - 1]
        return httpx.Response(status, headers=headers or {}, json={"errors": []})

    client = RegistryClient("127.0.0.1:5000")
    client.http = httpx.Client(transport=httpx.MockTransport(answer))
    client.retry_delays = (0.0, 0.0, 0.0, 0.0)
    return client, seen


def test_a_blob_check_answered_500_then_200_is_repeated_until_it_succeeds():
    client, seen = scripted([500, 503, 200])
    assert client.has_blob("team/demo", DIGEST) is True
    assert [r.method for r in seen] == ["HEAD"] * 3


def test_a_registry_that_keeps_failing_is_reported_after_the_last_repeat():
    client, seen = scripted([500])
    with pytest.raises(RegistryUnavailable, match="HTTP 500"):
        client.has_blob("team/demo", DIGEST)
    assert len(seen) == 1 + len(client.retry_delays)


@pytest.mark.parametrize("status", [400, 404, 501])
def test_answers_that_a_repeat_cannot_change_are_not_repeated(status):
    client, seen = scripted([status, 200])
    if status == 404:
        assert client.has_blob("team/demo", DIGEST) is False
    else:
        with pytest.raises(Exception):
            client.has_blob("team/demo", DIGEST)
    assert len(seen) == 1


def test_an_upload_is_never_repeated():
    """The blob is absent (HEAD 404); starting its upload meets a 500: no second POST."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(404 if request.method == "HEAD" else 500, json={"errors": []})

    client = RegistryClient("127.0.0.1:5000")
    client.http = httpx.Client(transport=httpx.MockTransport(answer))
    client.retry_delays = (0.0, 0.0, 0.0, 0.0)
    with pytest.raises(RegistryUnavailable, match="HTTP 500"):
        client.push_blob("team/demo", DIGEST, 3, data=b"abc")
    assert [r.method for r in seen] == ["HEAD", "POST"]


def test_retry_after_is_honoured_within_a_limit(monkeypatch):
    import qpcbuild.registry.client as client_mod

    pauses: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", pauses.append)
    client, _ = scripted([429, 429, 200], headers={"Retry-After": "120"})
    client.retry_delays = (0.25, 0.5)
    assert client.has_blob("team/demo", DIGEST) is True
    assert pauses == [client_mod.MAX_PAUSE_S, client_mod.MAX_PAUSE_S]  # 120 s capped


def manifest_answers(first: dict):
    """A client whose registry refuses the first manifest PUT with `first` (a 400's error
    body), then stores it; and the requests it saw."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(400, json=first) if len(seen) == 1 else httpx.Response(201)

    client = RegistryClient("127.0.0.1:5000")
    client.http = httpx.Client(transport=httpx.MockTransport(answer))
    client.retry_delays = (0.0, 0.0)
    return client, seen


def test_a_manifest_refused_in_the_blob_link_race_is_sent_again():
    """What two parallel builders met on Debian's docker-registry (tests/test_examples.py)."""
    client, seen = manifest_answers({"errors": [
        {"code": "DIGEST_INVALID", "message": "provided digest did not match uploaded content"},
        {"code": "MANIFEST_BLOB_UNKNOWN", "message": "blob unknown to registry"}]})
    digest = client.put_manifest("team/demo", "v1", {"schemaVersion": 2})
    assert [r.method for r in seen] == ["PUT", "PUT"]
    assert seen[0].content == seen[1].content and digest.startswith("sha256:")


@pytest.mark.parametrize("codes", [["MANIFEST_INVALID"], ["DIGEST_INVALID"],
                                   ["MANIFEST_BLOB_UNKNOWN", "NAME_UNKNOWN"]])
def test_any_other_refused_manifest_is_not_sent_again(codes):
    client, seen = manifest_answers({"errors": [{"code": c, "message": "no"} for c in codes]})
    with pytest.raises(RegistryError, match=codes[0]):
        client.put_manifest("team/demo", "v1", {"schemaVersion": 2})
    assert len(seen) == 1


def test_a_manifest_whose_blob_stays_unknown_fails_after_the_last_repeat():
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(400, json={"errors": [{"code": "MANIFEST_BLOB_UNKNOWN"}]})

    client = RegistryClient("127.0.0.1:5000")
    client.http = httpx.Client(transport=httpx.MockTransport(answer))
    client.retry_delays = (0.0, 0.0)
    with pytest.raises(RegistryError, match="MANIFEST_BLOB_UNKNOWN"):
        client.put_manifest("team/demo", "v1", {"schemaVersion": 2})
    assert len(seen) == 3
