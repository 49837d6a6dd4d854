"""The registry of schedule kinds: every record agrees with what its generator builds, the
lookups fail clearly, and the names callers used before the registry answer as before."""

import pytest

from hyperpipe.core.errors import BadInput
from hyperpipe.plan.kinds import (
    DEFAULT_KIND,
    GENERATED_KINDS,
    KINDS,
    SYNTH,
    generate,
    schedule_kind,
)
from hyperpipe.plan.schedule import rank_peaks

ALL = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v", "synth")


def test_the_kinds_in_listing_order():
    assert tuple(KINDS) == ALL
    assert GENERATED_KINDS == ALL[:-1]
    assert SYNTH == "synth" and DEFAULT_KIND == "1f1b"
    assert all(name == kind.name for name, kind in KINDS.items())


def test_the_properties_the_string_sets_held():
    """The sets that were spread over the callers, now read off the records."""
    def names(test):
        return {name for name, kind in KINDS.items() if test(kind)}
    assert names(lambda k: k.takes_chunks) == {"interleaved-1f1b", "synth"}
    assert names(lambda k: k.placement == "v") == {"zb-v", "dualpipe-v"}
    assert names(lambda k: k.default_chunks == 2) == {"zb-v", "dualpipe-v"}
    assert names(lambda k: k.splits_backward) == {"zb-h1", "zb-v", "dualpipe-v"}
    assert names(lambda k: k.closed_form) == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"}
    assert names(lambda k: k.carries_actions) == {"synth"}
    assert {n: k.torch_schedule for n, k in KINDS.items() if k.torch_schedule} == {
        "gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
        "zb-v": "ZBVZeroBubble", "dualpipe-v": "DualPipeV"}
    assert names(lambda k: "megatron" in k.runs_in) == {"1f1b", "interleaved-1f1b"}
    assert names(lambda k: "deepspeed" in k.runs_in) == {"1f1b"}


@pytest.mark.parametrize("name", GENERATED_KINDS)
def test_records_agree_with_their_generators(name):
    kind = schedule_kind(name)
    for p, m in ((2, 2), (3, 5), (4, 8)):
        for v in ((kind.default_chunks, 3) if kind.takes_chunks else (kind.default_chunks,)):
            sched = generate(name, p, m, v)
            assert sched.kind == name and sched.chunks == v
            assert sched.placement == kind.placement
            ops = {a.op for row in sched.actions for a in row}
            assert ("W" in ops) == kind.splits_backward, (p, m, v)


@pytest.mark.parametrize("name", [n for n in GENERATED_KINDS if KINDS[n].closed_form])
def test_closed_forms_of_stashes_agree_with_the_ir(name):
    kind = schedule_kind(name)
    for p in range(1, 6):
        for m in (p, 2 * p, 3 * p):
            for v in ((1, 2) if kind.takes_chunks else (1,)):
                counted = rank_peaks(generate(name, p, m, v))
                assert tuple(kind.peak_in_flight(p, m, v, r) for r in range(p)) == counted


def test_unknown_kinds_are_bad_input_naming_every_kind():
    with pytest.raises(BadInput, match="schedule kind: expected one of gpipe, 1f1b, "
                       "interleaved-1f1b, zb-h1, zb-v, dualpipe-v, synth"):
        schedule_kind("pipedream")
    with pytest.raises(BadInput, match="one of gpipe, .*, dualpipe-v, got 'synth'"):
        generate("synth", 2, 4)


def test_chunk_counts_each_kind_allows():
    assert schedule_kind("interleaved-1f1b").allows_chunks(3)
    assert schedule_kind("synth").allows_chunks(5)
    assert schedule_kind("zb-v").allows_chunks(2) and not schedule_kind("zb-v").allows_chunks(1)
    assert not schedule_kind("1f1b").allows_chunks(2)


@pytest.mark.parametrize("kind,p,m", [("zb-v", 3, 2), ("zb-v", 2, 7), ("dualpipe-v", 3, 2),
                                      ("dualpipe-v", 2, 9)])
def test_built_microbatches_are_what_the_v_generators_build(monkeypatch, kind, p, m):
    """The action limit counts what a generator builds, phantoms included: the V kinds
    build max(m, 2p - 1) or max(m, 2p) micro-batches and drop the rest after."""
    from hyperpipe.plan import generators_v
    from hyperpipe.plan.kinds import KINDS
    seen = []
    drop = generators_v._drop_phantoms
    monkeypatch.setattr(generators_v, "_drop_phantoms", lambda rows, m: (
        seen.append(1 + max(a.microbatch for row in rows for a in row)), drop(rows, m))[1])
    KINDS[kind].generator(p, m)
    assert seen == [KINDS[kind].built_microbatches(p, m)]


def test_the_action_limit_counts_phantom_micro_batches():
    """zb-v on 1,000 devices with 8 micro-batches builds 1,999 (12M actions: 33 s and
    1.8 GB before it was refused); interleaved pads where torch's flexible rounds do not
    divide m (3,331 on 10 devices: rounds of 333 leave one over, so 3,340 are built)
    and builds no phantom where they do (1 micro-batch on 1,000 devices)."""
    from hyperpipe.plan.kinds import over_action_limit
    assert "built as 1999" in over_action_limit("zb-v", 1000, 8, 2)
    assert "built as 3340" in over_action_limit("interleaved-1f1b", 10, 3331, 2)
    assert over_action_limit("interleaved-1f1b", 1000, 1, 4) is None
    assert over_action_limit("zb-v", 100, 200, 2) is None       # 120,000 actions
    assert over_action_limit("1f1b", 1000, 8, 1) is None
