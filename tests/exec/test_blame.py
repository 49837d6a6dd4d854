"""Which rank a failed run blames (`launch._blame`), from fabricated rank outcomes: the
reports the ranks leave (`launch._report` of the exception each raised), the ranks
that stopped answering and those seen dead. No rank is started."""

from __future__ import annotations

from hyperpipe.exec.comm import PeerFailure
from hyperpipe.exec.launch import _blame, _lost_peer, _report
from hyperpipe.exec.links import LinkEmulatorFailure

DEVICES = ["v100/0", "v100/1", "a100/0", "a100/1"]


def _gone(rank: int) -> LinkEmulatorFailure:
    """What a rank raises when its connection to the link emulator breaks."""
    try:
        raise LinkEmulatorFailure(f"rank {rank}: the link emulator is gone "
                                  "(EOFError)") from EOFError()
    except LinkEmulatorFailure as exc:
        return exc


def test_an_emulator_gone_with_rank_0_never_hides_a_rank_that_stopped_answering():
    """dp2 with emulated links, rank 1 stopped: rank 0's receive gives up (an echo),
    rank 0 exits and takes the link emulator (its child) with it, ranks 2 and 3 then
    lose it. Rank 1, silent, is the cause; the emulator's loss had been blamed."""
    reports = {0: _report(PeerFailure("recv from rank 1: no answer within 30 s"), 0, 100.0),
               2: _report(_gone(2), 2, 100.4), 3: _report(_gone(3), 3, 100.2)}
    silent = {1: (33.0, "stopped answering (no heartbeat for 33.0 s)")}
    died = {0: 100.1, 2: 100.5, 3: 100.3}
    failed = _blame(reports, silent, died, {}, {0: 1, 1: -15, 2: 1, 3: 1}, DEVICES)
    assert (failed.rank, failed.device) == (1, "v100/1")
    assert str(failed).startswith("rank 1 (v100/1) failed: stopped answering")


def test_an_emulator_gone_is_never_chosen_over_a_rank_that_failed_on_its_own():
    reports = {3: _report(_gone(3), 3, 100.0),
               1: _report(ValueError("loss is nan at step 1"), 1, 100.2)}
    failed = _blame(reports, {}, {1: 100.3, 3: 100.1}, {}, {1: 1, 3: 1}, DEVICES)
    assert str(failed) == "rank 1 (v100/1) failed: ValueError: loss is nan at step 1"


def test_an_emulator_that_died_by_itself_is_still_reported():
    """Nothing else failed: the earliest rank that lost the emulator names it."""
    reports = {r: _report(_gone(r), r, 100.0 + r) for r in range(4)}
    failed = _blame(reports, {}, {r: 100.5 + r for r in range(4)}, {},
                    dict.fromkeys(range(4), 1), DEVICES)
    assert str(failed) == ("rank 0 (v100/0) failed: LinkEmulatorFailure: rank 0: the "
                           "link emulator is gone (EOFError)")


def test_an_emulator_that_answers_nothing_is_a_cause_of_its_own():
    """A timeout waiting for the emulator's answer is not a broken connection."""
    assert _lost_peer(_gone(2))
    assert not _lost_peer(LinkEmulatorFailure("rank 2: the link emulator said nothing "
                                              "of flow 7 within 30 s"))


def test_a_rank_stopped_by_a_signal_names_it():
    """A SIGTERM to one rank had read 'Stopped: 15'."""
    from hyperpipe.core.errors import Stopped
    from hyperpipe.exec.launch import _cause
    assert _cause(Stopped(15)) == "stopped by SIGTERM"
    assert _cause(Stopped(1)) == "stopped by SIGHUP"
    failed = _blame({1: _report(Stopped(15), 1, 100.0)}, {}, {1: 100.1}, {}, {1: 1},
                    DEVICES)
    assert str(failed) == "rank 1 (v100/1) failed: stopped by SIGTERM"


def test_a_rank_killed_by_a_signal_without_a_name_is_still_blamed():
    """A real-time signal (40 here) has no `signal.Signals` name: the launcher had died
    with a ValueError instead of naming the rank."""
    failed = _blame({}, {}, {2: 100.0}, {}, {0: None, 1: None, 2: -40, 3: None}, DEVICES)
    assert str(failed) == "rank 2 (a100/0) failed: killed by signal 40"


def test_a_ranks_own_socket_error_is_a_cause_not_an_echo():
    """Only a connection the emulator's end broke is an echo; a rank out of file
    descriptors is a cause of its own."""
    try:
        raise LinkEmulatorFailure("rank 1: cannot reach the link emulator") \
            from OSError(24, "Too many open files")
    except LinkEmulatorFailure as exc:
        assert not _lost_peer(exc)
