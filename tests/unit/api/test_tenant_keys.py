"""API keys: records, the Bearer header, a constant-time check over every record, nothing leaked."""
from __future__ import annotations

import hmac

import pytest

from gpufleet_api.tenants import keys
from gpufleet_api.tenants.identity import Identified, Refused
from gpufleet_api.typed import Invalid

KEY_A = keys.new_key(bytes(range(32)))
KEY_B = keys.new_key(bytes(range(1, 33)))
SALT = bytes(16)


def table(**secrets: str) -> keys.KeyTable:
    return keys.KeyTable.parse(secrets)


def test_a_key_has_its_prefix_and_256_random_bits():
    assert KEY_A.startswith("gfk_") and len(KEY_A) == 4 + 43
    with pytest.raises(ValueError):
        keys.new_key(b"short")


def test_a_record_holds_the_salted_hash_not_the_key():
    line = keys.record(KEY_A, SALT)
    assert KEY_A not in line and KEY_A[4:] not in line
    assert line.startswith("sha256:" + SALT.hex() + ":")
    # The same key under two salts: two unrelated records, reuse cannot be seen.
    assert keys.record(KEY_A, bytes([1] * 16)).split(":")[2] != line.split(":")[2]


def test_the_right_key_names_its_tenant():
    t = table(a=keys.record(KEY_A, SALT), b=keys.record(KEY_B, bytes([7] * 16)))
    assert t.identify(f"Bearer {KEY_A}") == Identified("a")
    assert t.identify(f"bearer   {KEY_B}  ") == Identified("b")


def test_rotation_two_records_of_one_tenant_both_valid():
    t = table(a=f"# rotating\n{keys.record(KEY_A, SALT)}\n\n{keys.record(KEY_B, bytes([3] * 16))}\n")
    assert t.identify(f"Bearer {KEY_A}") == t.identify(f"Bearer {KEY_B}") == Identified("a")


@pytest.mark.parametrize("header,reason", [
    (None, "missing"), ("", "missing"), ("   ", "missing"),
    ("Basic dXNlcjpwYXNz", "malformed"), ("Bearer", "malformed"), ("Bearer a b", "malformed"),
    ("Bearer " + "x" * (keys.MAX_KEY_LENGTH + 1), "malformed"), ("Bearer k\u00e9y", "malformed"),
    ("Bearer gfk_wrong", "unknown"),
])
def test_a_caller_without_a_valid_key_is_refused_with_its_reason(header, reason):
    t = table(a=keys.record(KEY_A, SALT))
    out = t.identify(header)
    assert isinstance(out, Refused) and out.reason == reason and out.message


def test_a_key_in_two_tenants_secrets_identifies_neither():
    t = table(a=keys.record(KEY_A, SALT), b=keys.record(KEY_A, bytes([9] * 16)))
    assert t.identify(f"Bearer {KEY_A}") == Refused("unknown", keys.MESSAGES["unknown"])


def test_every_record_is_compared_whichever_matches(monkeypatch):
    """No early exit: the first record matching still costs the comparisons of all the others."""
    t = table(a=keys.record(KEY_A, SALT), b=keys.record(KEY_B, bytes([2] * 16)),
              c=keys.record(keys.new_key(bytes([5] * 32)), bytes([4] * 16)))
    calls = []
    real = hmac.compare_digest

    def counting(x, y):
        calls.append(1)
        return real(x, y)

    monkeypatch.setattr(keys.hmac, "compare_digest", counting)
    for header in (f"Bearer {KEY_A}", f"Bearer {KEY_B}", "Bearer gfk_nothing"):
        calls.clear()
        t.identify(header)
        assert len(calls) == 3


def test_the_key_never_appears_in_a_refusal_a_repr_or_an_error():
    t = table(a=keys.record(KEY_A, SALT))
    wrong = KEY_B
    out = t.identify(f"Bearer {wrong}")
    assert wrong not in repr(out) and wrong not in out.message
    assert "sha256" not in repr(t) and SALT.hex() not in repr(t)
    with pytest.raises(Invalid) as e:
        keys.KeyTable.parse({"a": wrong}, where={"a": "secret a-keys, key keys"})
    assert wrong not in str(e.value)
    assert "line 1 of secret a-keys, key keys" in str(e.value)


def test_every_bad_line_is_named():
    with pytest.raises(Invalid) as e:
        keys.KeyTable.parse({"a": "sha256:zz:00\nmd5:1:2", "b": keys.record(KEY_B, SALT)})
    assert [p.loc for p in e.value.problems] == [("a", 1), ("a", 2)]


def test_an_empty_table_refuses_every_key():
    assert keys.KeyTable.parse({}).identify(f"Bearer {KEY_A}").reason == "unknown"  # type: ignore[union-attr]
