"""The controller's version ledger: monotonic publication, retries with backoff after failed
loads, giving up, superseded loads, per-instance version history, releasable versions."""

from __future__ import annotations

import pytest

from libra.sync.versions import LoadTask, VersionLedger


def test_publish_load_retry_and_give_up():
    ledger = VersionLedger(max_attempts=3, backoff_s=1.0)
    ledger.add_instance("a")
    ledger.add_instance("b")
    assert ledger.due(now=0.0) == []
    ledger.publish(1)
    with pytest.raises(ValueError, match="greater than"):
        ledger.publish(1)
    assert ledger.due(now=0.0) == [LoadTask("a", 1, 1), LoadTask("b", 1, 1)]
    ledger.loaded("a", 1, now=1.0)
    ledger.failed("b", 1, "stream broke", now=1.0)
    assert ledger.version_of("b") == 0
    assert ledger.due(now=1.5) == []  # backoff 1 s
    assert ledger.due(now=2.0) == [LoadTask("b", 1, 2)]
    ledger.failed("b", 1, "stream broke", now=2.0)
    assert ledger.due(now=3.9) == []  # backoff doubles
    assert ledger.due(now=4.0) == [LoadTask("b", 1, 3)]
    ledger.failed("b", 1, "checksum", now=4.0)
    assert ledger.due(now=100.0) == []
    assert ledger.given_up() == {"b": "checksum"}
    # A newer version supersedes the failed one and resets the attempts.
    ledger.publish(2)
    assert ledger.given_up() == {}
    assert ledger.due(now=100.0) == [LoadTask("a", 2, 1), LoadTask("b", 2, 1)]
    ledger.failed("b", 1, "late report of the old load", now=100.0)  # ignored: superseded
    assert ledger.due(now=100.0) == [LoadTask("a", 2, 1), LoadTask("b", 2, 1)]


def test_history_release_and_bad_reports():
    ledger = VersionLedger()
    ledger.add_instance("a", now=0.0)
    ledger.add_instance("b", now=0.0)
    for version, now in ((1, 10.0), (2, 20.0), (3, 30.0)):
        ledger.publish(version)
        ledger.loaded("a", version, now=now + 1)
    ledger.loaded("b", 2, now=25.0)
    assert [ledger.version_at("a", t) for t in (0.0, 10.5, 11.0, 21.0, 99.0)] == [0, 0, 1, 2, 3]
    assert ledger.version_at("b", 24.0) == 0 and ledger.version_at("b", 26.0) == 2
    assert ledger.releasable() == [1]  # 2 is in use by b, 3 is the latest, 0 is the checkpoint
    ledger.forget([1])
    with pytest.raises(ValueError, match="went back"):
        ledger.loaded("a", 2, now=40.0)
    with pytest.raises(ValueError, match="never published"):
        ledger.loaded("b", 7, now=40.0)
    with pytest.raises(LookupError, match="unknown rollout instance"):
        ledger.version_of("zzz")
