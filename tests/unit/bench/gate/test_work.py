"""bench.gate.work: the work counters' verdict lines, for hand-set counters, censuses and accepted sizes."""

from __future__ import annotations

import pytest
from result_docs import make_doc

from bench.gate.accept import Acceptance
from bench.gate.compare import compare
from bench.gate.work import (
    accepted_work_names,
    describe_work_change,
    has_work_counters,
    work_findings,
    work_verdicts,
)
from bench.metrics import WORK_METRIC_NAMES
from bench.results import ResultDocument, metric

MIB = 2**20


def counters(**values: float) -> dict:
    return {name: metric([value], "count", "lower") for name, value in values.items()}


def ranks(*censuses: dict) -> dict:
    """``details`` with one work census per rank, ranks numbered in order."""
    return {"work": {"ranks": [{"rank": r, **census} for r, census in enumerate(censuses)]}}


def test_accepted_work_names():
    assert accepted_work_names(True) == frozenset(WORK_METRIC_NAMES)
    assert accepted_work_names(None) == frozenset()
    assert accepted_work_names(False) == frozenset()
    assert accepted_work_names(["work_aten_ops"]) == frozenset({"work_aten_ops"})


def test_has_work_counters():
    assert has_work_counters(counters(work_aten_ops=1))
    assert has_work_counters({"work_flops_ratio": {}})
    assert not has_work_counters(counters(step_time_s=1))
    assert not has_work_counters({})


def test_no_line_without_counters_on_either_side_and_one_note_for_one_side():
    assert work_verdicts("s", (counters(step_time_s=1), None), (counters(step_time_s=2), None)) == []
    assert work_verdicts("s", ({}, None), (counters(work_aten_ops=3), None), machine="m") == [
        "NOTE s: no work counters on one side (the baseline); work not compared [m]"
    ]
    assert work_verdicts("s", (counters(work_aten_ops=3), None), ({}, None)) == [
        "NOTE s: no work counters on one side (the candidate); work not compared"
    ]


def test_unchanged_ungated_or_one_sided_counters_say_nothing():
    same = (counters(work_aten_ops=5, work_host_syncs=1), None)
    assert work_verdicts("s", same, same) == []
    ungated = {"work_aten_ops": metric([7], "ops", None)}
    assert work_verdicts("s", (counters(work_aten_ops=5), None), (ungated, None)) == []
    assert work_verdicts("s", (counters(work_aten_ops=5), None), (counters(work_host_syncs=2), None)) == []


def test_lines_follow_the_metric_order_with_increases_failing_and_decreases_noted():
    base = (counters(work_host_syncs=3, work_aten_ops=10), None)
    cand = (counters(work_host_syncs=2, work_aten_ops=11), None)
    assert work_verdicts("s", base, cand, machine="cpu") == [
        "REGRESSION s work_aten_ops: work increased: +1 op per step (+10.0%, 10 -> 11) [cpu]",
        "NOTE s work_host_syncs: work decreased: -1 host sync per step (3 -> 2) [cpu]",
    ]


def test_an_accepted_increase_is_a_note_naming_why():
    base, cand = (counters(work_aten_ops=10), None), (counters(work_aten_ops=12), None)
    change = "+2 ops per step (+20.0%, 10 -> 12)"
    assert work_verdicts("s", base, cand, accept={"work_aten_ops"}) == [
        f"NOTE s work_aten_ops: work increased (accepted): {change}"
    ]
    assert work_verdicts("s", base, cand, accept=True) == [f"NOTE s work_aten_ops: work increased (accepted): {change}"]
    assert work_verdicts("s", base, cand, accept={"work_host_syncs"})[0].startswith("REGRESSION")


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (0.2, "NOTE s work_aten_ops: work increased (accepted: more ops (--accept, up to 20%)): {change}"),
        (
            0.19,
            "REGRESSION s work_aten_ops: work increased: {change}; beyond the accepted change: more ops "
            "(--accept, up to 19%)",
        ),
    ],
)
def test_an_acceptance_covers_a_work_increase_up_to_its_size(size, expected):
    base, cand = (counters(work_aten_ops=10), None), (counters(work_aten_ops=12), None)
    acceptance = Acceptance(("work_aten_ops",), ("s",), size, "more ops")
    change = "+2 ops per step (+20.0%, 10 -> 12)"
    assert work_verdicts("s", base, cand, acceptances=[acceptance]) == [expected.format(change=change)]
    # An acceptance of another scenario changes nothing.
    other = Acceptance(("work_aten_ops",), ("t",), 1.0, "more ops")
    assert work_verdicts("s", base, cand, acceptances=[other]) == [
        f"REGRESSION s work_aten_ops: work increased: {change}"
    ]


def test_a_side_may_be_a_document_its_json_or_a_pair():
    data_b = make_doc("s", counters(work_aten_ops=4))
    data_b["details"] = ranks({"ops_by_name": {"aten.mm.default": 4}})
    data_c = make_doc("s", counters(work_aten_ops=5))
    data_c["details"] = ranks({"ops_by_name": {"aten.mm.default": 5}})
    expected = ["REGRESSION s work_aten_ops: work increased: +1 op per step (+25.0%, 4 -> 5): aten.mm.default +1"]
    assert work_verdicts("s", ResultDocument(data_b), ResultDocument(data_c)) == expected
    assert work_verdicts("s", data_b, data_c) == expected
    pair_b = (data_b["metrics"], data_b["details"])
    assert work_verdicts("s", pair_b, (data_c["metrics"], data_c["details"])) == expected


@pytest.mark.parametrize(
    ("name", "base", "cand", "expected"),
    [
        ("work_matmul_flops", 1e9, 1.5e9, "+50.0% matmul FLOPs per step (1e+09 -> 1.5e+09)"),
        ("work_matmul_flops", 0, 2048, "+2048 matmul FLOPs per step (0 -> 2048)"),
        ("work_allocated_bytes", 4 * MIB, 6 * MIB, "+2 MiB allocated per step (+50.0%, 4 MiB -> 6 MiB)"),
        ("work_allocated_bytes", 0, 512, "+512 B allocated per step (0 B -> 512 B)"),
        ("work_allocated_bytes", 1536, 1024, "-512 B allocated per step (-33.3%, 1.5 KiB -> 1 KiB)"),
        ("work_aten_ops", 10, 9, "-1 op per step (-10.0%, 10 -> 9)"),
        ("work_aten_ops", 0, 3, "+3 ops per step (0 -> 3)"),
        ("work_host_syncs", 1, 3, "+2 host syncs per step (1 -> 3)"),
        ("work_collective_calls", 2, 3, "+1 collective calls per step (2 -> 3)"),
        ("work_collective_bytes", 8 * MIB, 12 * MIB, "+4 MiB of collectives per step (8 MiB -> 12 MiB)"),
    ],
)
def test_describe_work_change_without_a_census(name, base, cand, expected):
    assert describe_work_change(name, base, cand, {}, {}) == expected


def test_census_entries_largest_change_first_then_by_name():
    base = {0: {"ops_by_name": {"aten.clone.default": 3, "aten.add.Tensor": 1, "aten.mul.Tensor": 2, "aten.mm": 1}}}
    cand = {0: {"ops_by_name": {"aten.clone.default": 5, "aten.mul.Tensor": 3, "aten.view": 1, "aten.mm": 1}}}
    text = describe_work_change("work_aten_ops", 7, 10, base, cand)
    assert text == (
        "+3 ops per step (+42.9%, 7 -> 10): aten.clone.default +2, aten.add.Tensor -1, aten.mul.Tensor +1, aten.view +1"
    )


def test_more_than_four_census_changes_are_counted():
    base = {0: {"syncs_by_site": {f"site{i}": 1 for i in range(6)}}}
    cand = {0: {"syncs_by_site": {f"site{i}": 2 for i in range(6)}}}
    text = describe_work_change("work_host_syncs", 6, 12, base, cand)
    assert text == "+6 host syncs per step (6 -> 12): site0 +1, site1 +1, site2 +1, site3 +1, 2 more"


def test_census_changes_per_rank():
    base = {0: {"allocated_by_op": {"aten.empty": MIB}}, 1: {"allocated_by_op": {"aten.empty": MIB}}}
    alike = {0: {"allocated_by_op": {"aten.empty": 2 * MIB}}, 1: {"allocated_by_op": {"aten.empty": 2 * MIB}}}
    assert describe_work_change("work_allocated_bytes", 2 * MIB, 4 * MIB, base, alike) == (
        "+2 MiB allocated per step (+100.0%, 2 MiB -> 4 MiB): aten.empty +1 MiB on each of 2 ranks"
    )
    unlike = {0: {"allocated_by_op": {"aten.empty": 3 * MIB}}, 1: {"allocated_by_op": {"aten.empty": MIB}}}
    assert describe_work_change("work_allocated_bytes", 2 * MIB, 4 * MIB, base, unlike).endswith(
        ": aten.empty +2 MiB on rank 0"
    )
    flops_b = {0: {"flops_by_op": {"mm": 100}}, 1: {"flops_by_op": {"mm": 100}}}
    flops_c = {0: {"flops_by_op": {"mm": 300}}, 1: {"flops_by_op": {"mm": 200}}}
    assert describe_work_change("work_matmul_flops", 200, 500, flops_b, flops_c) == (
        "+150.0% matmul FLOPs per step (200 -> 500): mm +200 on rank 0, +100 on rank 1"
    )


def collective(op: str, group: str, calls: int, nbytes: int) -> dict:
    return {"op": op, "group": group, "calls": calls, "bytes": nbytes}


def test_collective_calls_read_from_the_census():
    base = {0: {"collectives": [collective("all_reduce", "dp", 2, 8 * MIB)]}}
    cand = {0: {"collectives": [collective("all_reduce", "dp", 3, 12 * MIB)]}}
    assert describe_work_change("work_collective_calls", 2, 3, base, cand) == "+1 all_reduce of 4 MiB per step (dp)"
    assert describe_work_change("work_collective_bytes", 8 * MIB, 12 * MIB, base, cand) == (
        "+4 MiB of collectives per step (8 MiB -> 12 MiB): +1 all_reduce of 4 MiB per step (dp)"
    )


@pytest.mark.parametrize(
    ("base_entry", "cand_entry", "expected"),
    [
        # Same calls, more bytes each.
        ((2, 8 * MIB), (2, 12 * MIB), "all_reduce (dp) +4 MiB per step over the same 2 calls"),
        ((1, 8 * MIB), (1, 4 * MIB), "all_reduce (dp) -4 MiB per step over the same 1 call"),
        # More calls that move nothing.
        ((1, 0), (2, 0), "+1 all_reduce per step (dp)"),
        # Calls and bytes moving apart.
        ((2, 8 * MIB), (3, 7 * MIB), "+1 all_reduce per step (dp), -1 MiB in all"),
        ((2, 8 * MIB), (1, 4 * MIB), "-1 all_reduce of 4 MiB per step (dp)"),
        # A collective that is new in the candidate.
        (None, (1, 1024), "+1 all_reduce of 1 KiB per step (dp)"),
    ],
)
def test_collective_changes_of_one_rank(base_entry, cand_entry, expected):
    def side(entry):
        return {0: {"collectives": [collective("all_reduce", "dp", *entry)] if entry else []}}

    assert describe_work_change("work_collective_calls", 1, 2, side(base_entry), side(cand_entry)) == expected


def test_collective_changes_over_ranks():
    base = {r: {"collectives": [collective("all_to_all", "ep", 2, 2 * MIB)]} for r in (0, 1)}
    alike = {r: {"collectives": [collective("all_to_all", "ep", 4, 4 * MIB)]} for r in (0, 1)}
    assert describe_work_change("work_collective_calls", 4, 8, base, alike) == (
        "+2 all_to_all of 1 MiB per step (ep) on each of 2 ranks"
    )
    unlike = {0: alike[0], 1: base[1]}
    assert describe_work_change("work_collective_calls", 4, 6, base, unlike) == (
        "+2 all_to_all of 1 MiB per step (ep) on rank 0"
    )


def test_work_findings_compare_pooled_counters_of_every_compared_scenario():
    def doc(name, ops, stamp, ranks_ops=None, machine="m"):
        data = make_doc(name, counters(work_aten_ops=ops), timestamp=stamp, machine=machine)
        if ranks_ops is not None:
            data["details"] = ranks({"ops_by_name": ranks_ops})
        return ResultDocument(data)

    base = [
        doc("a", 10, "2025-01-01T00:00:00Z"),
        doc("a", 10, "2025-01-02T00:00:00Z", {"aten.add": 10}),
        doc("b", 5, "2025-01-01T00:00:00Z"),
    ]
    cand = [
        # The pooled median is 12: the newest run's census explains it.
        doc("a", 12, "2025-01-01T00:00:00Z", {"aten.add": 99}),
        doc("a", 12, "2025-01-02T00:00:00Z", {"aten.add": 12}),
        # Under another machine name: a key of its own on each side, so nothing compared.
        doc("b", 9, "2025-01-01T00:00:00Z", machine="n"),
    ]
    comparison = compare(base, cand)
    assert comparison.compared == (("a", "m"),)
    assert work_findings(comparison) == [
        "REGRESSION a work_aten_ops: work increased: +2 ops per step (+20.0%, 10 -> 12): aten.add +2 [m]"
    ]
    assert work_findings(comparison, accept=True)[0].startswith("NOTE a work_aten_ops: work increased (accepted)")
    from_release = Acceptance(("work_aten_ops",), ("a",), 0.5, "why", release="0.2.0")
    # The release is not between the two versions (both 0.1.0): it does not apply.
    assert work_findings(comparison, acceptances=[from_release])[0].startswith("REGRESSION")
