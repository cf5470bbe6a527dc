"""Tenants (issue 21, item 5) without processes: the keys file, namespaced request ids, the
latency-class ceiling and the per-key quota. tests/test_cluster_tenants.py runs them on a
real cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.errors import ERROR_CLASSES, ErrorKind, QuotaExceededError, kind_of
from pdserve.tenants import OPEN, OPERATOR, KeyPolicy, Tenants, key_tag, load_keys_file, parse_keys
from pdserve.types import MAX_REQUEST_ID_LEN, LatencyClass, check_request_id

KEYS = """\
# tenants
sk-alice-0123456789  max_concurrent=2 max_class=standard
sk-ops-0123456789    admin

sk-bob-0123456789
sk-#hash-in-key
"""


def test_keys_file_lines_and_attributes() -> None:
    p = parse_keys(KEYS)
    assert p["sk-alice-0123456789"] == KeyPolicy(max_concurrent=2,
                                                 max_class=LatencyClass.STANDARD)
    assert p["sk-ops-0123456789"] == KeyPolicy(admin=True)
    assert p["sk-bob-0123456789"] == KeyPolicy()  # a bare key: no quota, any class, no admin
    assert "sk-#hash-in-key" in p
    assert len(p) == 4


@pytest.mark.parametrize("line, problem", [
    ("sk-secret-key colour=blue", "unknown attribute 'colour'"),
    ("sk-secret-key max_concurrent=0", "max_concurrent must be >= 1"),
    ("sk-secret-key max_concurrent=many", "bad max_concurrent"),
    ("sk-secret-key max_class=urgent", "bad max_class"),
    ("sk-secret-key admin=no", "bad admin"),
    ("sk-secret-key\nsk-secret-key", "line 2: repeats the key of line 1"),
])
def test_keys_file_errors_name_the_line_never_the_key(line: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as err:
        parse_keys(line)
    assert "sk-secret-key" not in str(err.value)


def test_keys_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(KEYS)
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_keys_file(path)
    path.chmod(0o600)
    assert len(load_keys_file(path)) == 4
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_keys_file(path)


def test_request_ids_are_namespaced_per_key() -> None:
    tenants = Tenants(["sk-ops-0123456789"], parse_keys(KEYS))
    alice = tenants.identify("sk-alice-0123456789")
    bob = tenants.identify("sk-bob-0123456789")
    assert alice is not None and bob is not None
    assert alice.request_id("job-1") != bob.request_id("job-1")
    assert alice.request_id("job-1") == alice.request_id("job-1")  # the owner finds it again
    assert "sk-alice" not in alice.request_id("job-1")  # a tag, never the key
    assert alice.request_id("job-1") == f"{key_tag('sk-alice-0123456789')}:job-1"
    longest = "x" * MAX_REQUEST_ID_LEN
    for tenant in (alice, bob):
        check_request_id(tenant.request_id(longest))  # still a valid id
    assert alice.request_id(longest) != bob.request_id(longest)
    assert OPEN.request_id("job-1") == "job-1"  # an open API: ids as today


def test_identify() -> None:
    tenants = Tenants(["sk-ops-0123456789"], parse_keys(KEYS))
    assert tenants.enabled
    ops = tenants.identify("sk-ops-0123456789")
    assert ops is not None and ops.policy == KeyPolicy(admin=True)
    legacy = Tenants(["sk-legacy-01234567"]).identify("sk-legacy-01234567")
    assert legacy is not None and legacy.policy == OPERATOR  # --api-key: admin, as before
    assert tenants.identify("sk-nobody") is None
    assert tenants.identify(None) is None
    assert Tenants().identify(None) is OPEN and not Tenants().enabled
    # A keys-file policy wins over the operator default for the same key.
    both = Tenants(["sk-bob-0123456789"], {"sk-bob-0123456789": KeyPolicy()})
    bob = both.identify("sk-bob-0123456789")
    assert bob is not None and not bob.policy.admin


def test_latency_class_ceiling_downgrades() -> None:
    alice = Tenants([], parse_keys(KEYS)).identify("sk-alice-0123456789")
    assert alice is not None
    assert alice.latency_class(LatencyClass.INTERACTIVE) is LatencyClass.STANDARD
    assert alice.latency_class(LatencyClass.STANDARD) is LatencyClass.STANDARD
    assert alice.latency_class(LatencyClass.BATCH) is LatencyClass.BATCH
    assert OPEN.latency_class(LatencyClass.INTERACTIVE) is LatencyClass.INTERACTIVE


def test_quota_per_key() -> None:
    tenants = Tenants([], parse_keys(KEYS))
    alice = tenants.identify("sk-alice-0123456789")
    bob = tenants.identify("sk-bob-0123456789")
    assert alice is not None and bob is not None
    first, second = tenants.admit(alice), tenants.admit(alice)
    with pytest.raises(QuotaExceededError) as err:
        tenants.admit(alice)
    assert kind_of(err.value) is ErrorKind.RESOURCE_EXHAUSTED  # 429 / RESOURCE_EXHAUSTED
    assert err.value.code == "quota_exceeded" and ERROR_CLASSES["quota_exceeded"] is \
        QuotaExceededError
    with tenants.admit(bob):  # another key's quota is its own
        assert tenants.in_flight(bob) == 1
    assert tenants.in_flight(bob) == 0
    first.release()
    first.release()  # idempotent
    assert tenants.in_flight(alice) == 1
    tenants.admit(alice).release()
    second.release()
    assert tenants.in_flight(alice) == 0


def test_cli_reads_the_keys_file_beside_the_operator_keys(tmp_path: Path) -> None:
    from pdserve.cli import build_parser
    from pdserve.cli_args import api_key_policies, api_keys

    path = tmp_path / "keys"
    path.write_text(KEYS)
    path.chmod(0o600)
    args = build_parser().parse_args(["router", "--api-key", "sk-op", "--api-key-file",
                                      str(path)])
    assert api_keys(args, env={}) == ["sk-op", "sk-alice-0123456789", "sk-ops-0123456789",
                                      "sk-bob-0123456789", "sk-#hash-in-key"]
    assert api_key_policies(args, env={})["sk-ops-0123456789"].admin
    plain = build_parser().parse_args(["router"])
    assert api_key_policies(plain, env={"PDSERVE_API_KEY_FILE": str(path)}) == parse_keys(KEYS)
    assert api_keys(plain, env={}) == [] and api_key_policies(plain, env={}) == {}
    path.write_text("sk-secret-key colour=blue\n")
    with pytest.raises(SystemExit, match="line 1") as err:
        api_key_policies(args, env={})
    assert "sk-secret-key" not in str(err.value)
