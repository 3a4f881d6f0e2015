"""Several variants of a scenario side by side: the rotation, the ratio arithmetic, the spec patches,
the measurement loop (fake workers), and one real run that leaves no process behind."""

from __future__ import annotations

import itertools
import json

import pytest
import yaml
from variant_scenario import TINY, write_tiny

from bench.ab import resident
from bench.scenario import SCENARIOS_DIR, load_scenario, scenario_from_dict
from bench.validate import compile_speedup, recompute_cost, variants
from bench.validate.variants import Variant


@pytest.fixture
def tiny_file(tmp_path):
    return write_tiny(tmp_path)


def tiny_scenario(path):
    return scenario_from_dict(yaml.safe_load(path.read_text()), path)


# --- the rotation -------------------------------------------------------------------------------


NAMES = ["a", "b", "c"]


def test_every_round_pairs_each_variant_once_with_the_base():
    for index in range(6):
        pairs = variants.rotation(NAMES, index, "base")
        assert sorted(p for pair in pairs for p in pair if p != "base") == NAMES
        assert all(pair.count("base") == 1 for pair in pairs)


def test_who_goes_first_alternates_round_by_round_for_every_variant():
    for name in NAMES:
        firsts = []
        for index in range(6):
            (pair,) = [p for p in variants.rotation(NAMES, index, "base") if name in p]
            firsts.append(pair[0])
        assert firsts == ["base", name] * 3


def test_a_variants_place_in_the_round_changes_every_round_and_visits_every_place():
    places = {name: [] for name in NAMES}
    for index in range(6):
        for place, pair in enumerate(variants.rotation(NAMES, index, "base")):
            places[next(p for p in pair if p != "base")].append(place)
    for name, seen in places.items():
        assert all(x != y for x, y in itertools.pairwise(seen)), (name, seen)
        assert sorted(set(seen)) == [0, 1, 2]


def test_one_variant_alternates_as_the_ab_gate_does():
    blocks = [label for index in range(4) for pair in variants.rotation(["v"], index, "base") for label in pair]
    assert blocks == ["base", "v", "v", "base"] * 2


# --- the summary arithmetic ---------------------------------------------------------------------


def test_the_summary_by_hand():
    # Ratios base / variant: 2/1, 3/2, 4/2 = 2, 1.5, 2.
    s = variants.ratio_summary([2.0, 3.0, 4.0], [1.0, 2.0, 2.0])
    assert s["per_pair"] == [2.0, 1.5, 2.0]
    assert (s["median"], s["min"], s["max"]) == (2.0, 1.5, 2.0)
    assert s["quartiles"] == pytest.approx([1.75, 2.0])  # inclusive: 1.5 + (2 - 1.5) / 2, and 2
    # Walsh averages of the logs: ln 1.5, m, m, ln 2, ln 2, ln 2 with m = (ln 1.5 + ln 2) / 2; their
    # median is (m + ln 2) / 2, exp of which is (1.5 * 2^3)^(1/4) = 12^(1/4).
    assert s["hodges_lehmann"] == pytest.approx(12**0.25)
    # 3 pairs: no signed-rank statistic is rarer than 2.5% (1/8), k = 1: the extreme Walsh averages.
    assert s["interval_95"] == pytest.approx([1.5, 2.0])


def test_a_slower_variant_has_a_ratio_below_one():
    s = variants.ratio_summary([1.0, 1.0], [2.0, 2.0])
    assert s["median"] == s["hodges_lehmann"] == pytest.approx(0.5)
    assert s["interval_95"] == pytest.approx([0.5, 0.5])


def test_one_pair_has_no_interval():
    s = variants.ratio_summary([1.0], [0.8])
    assert s["median"] == pytest.approx(1.25) and "interval_95" not in s and "quartiles" not in s


def test_the_compile_speedup_summary_is_the_same_arithmetic():
    assert compile_speedup.speedup_summary([2.0, 3.0], [1.0, 2.0]) == variants.ratio_summary([2.0, 3.0], [1.0, 2.0])


# --- the spec patches ---------------------------------------------------------------------------


def leaves(tree, prefix=()):
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(leaves(value, (*prefix, key)))
        return out
    return {prefix: tree}


def differences(a, b):
    la, lb = leaves(a), leaves(b)
    return {path for path in la.keys() | lb.keys() if la.get(path, "<absent>") != lb.get(path, "<absent>")}


@pytest.mark.parametrize(
    "variant", [*recompute_cost.MODES, recompute_cost.CONTROL, compile_speedup.COMPILED], ids=lambda v: v.name
)
def test_a_patched_spec_validates_and_differs_only_where_the_patch_says(tiny_file, variant):
    scenario = tiny_scenario(tiny_file)
    written = variants.spec_as_written(scenario)
    merged = variants.merge(written, variant.patch)
    assert differences(written, merged) <= set(leaves(variant.patch))
    assert merged["recompute"]["every"] == 2 and merged["run"]["steps"] == 2  # the siblings stay
    assert written == {**TINY, "name": "tiny-variants"}  # nothing changed in place
    result = variants.patched(scenario, variant.patch)
    assert result.file is None  # a worker takes this spec, not the file's
    assert result.name == scenario.name
    recompute = variant.patch.get("recompute", TINY["recompute"])
    assert result.recompute.mode.value == recompute["mode"]
    assert [p.value for p in result.recompute.parts] == recompute.get("parts", [])
    assert result.run.compile is variant.patch.get("run", {}).get("compile", False)
    # The as-run specs (defaults filled) differ only in what the patch sets.
    assert differences(scenario.spec, result.spec) <= set(leaves(variant.patch))


def test_a_list_in_a_patch_replaces_the_files_list(tmp_path):
    path = tmp_path / "sel.yaml"
    path.write_text(yaml.safe_dump({**TINY, "recompute": {"mode": "selective", "parts": ["attention", "norms"]}}))
    result = variants.patched(tiny_scenario(path), {"recompute": {"mode": "selective", "parts": ["experts"]}})
    assert [p.value for p in result.recompute.parts] == ["experts"]
    full = variants.patched(tiny_scenario(path), recompute_cost.MODES[0].patch)
    assert full.recompute.mode.value == "full" and full.recompute.parts == []


# --- the measurement loop, with fake workers ----------------------------------------------------


class FakeSide:
    """A worker with a known step time: the loop's logic without processes or noise."""

    def __init__(self, per_step_s, order, started, label, root, scenario, device, timeout_s):
        self.label, self.per_step_s, self.order, self.scenario = label, per_step_s[label], order, scenario
        self.last_losses = []
        started.append((label, scenario))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.order.append(f"closed {self.label}")

    def block(self, steps):
        self.order.append(self.label)
        # The loss goes down as a worker trains: block after block.
        self.last_losses = [1.0 + 0.01 * self.per_step_s - 0.1 * self.order.count(self.label)] * steps
        return steps * self.per_step_s


def fake_measure(scenario, per_step_s, names, pairs=4):
    order, started = [], []
    factory = lambda *args: FakeSide(per_step_s, order, started, *args)
    base, others = Variant(names[0], {}), [Variant(n, {"run": {"compile": False}}) for n in names[1:]]
    row = variants.measure(scenario, base, others, "cpu", pairs, 0.5, 60, factory)
    return row, order, started


def test_the_loop_probes_settles_then_runs_the_rotation_and_closes_every_worker(tiny_file):
    row, order, started = fake_measure(tiny_scenario(tiny_file), {"b": 0.01, "x": 0.02, "y": 0.005}, ["b", "x", "y"])
    assert [label for label, _ in started] == ["b", "x", "y"]
    assert order[:6] == ["b", "x", "y"] * 2  # probe, then one unrecorded block each
    expected = [label for index in range(4) for pair in variants.rotation(["x", "y"], index, "b") for label in pair]
    assert order[6 : 6 + len(expected)] == expected
    assert sorted(order[6 + len(expected) :]) == ["closed b", "closed x", "closed y"]
    assert row["steps_per_block"] == 100  # 0.5 s from the fastest worker's step (5 ms)
    assert row["ratios"]["x"]["median"] == pytest.approx(0.5) and row["ratios"]["y"]["median"] == pytest.approx(2.0)
    assert row["order"][1] == [["y", "b"], ["x", "b"]]
    assert len(row["block_s"]["b"]) == 8 and len(row["base_block_s"]["x"]) == 4
    assert row["tokens_per_s_median"]["x"] == pytest.approx(128 / 0.02)
    # Each worker's 6th block (probe, settle, 4 timed): the base's is the 4th of its 8 timed blocks.
    assert row["last_block_losses"]["b"] == pytest.approx([1.0001 - 0.6] * 100)
    assert row["last_block_loss_max_rel_diff"]["x"] == pytest.approx(0.0001 / 0.4001)


def test_compile_speedup_keeps_its_rows(tiny_file):
    order, started = [], []
    factory = lambda *args: FakeSide({"eager": 0.02, "compiled": 0.01}, order, started, *args)
    row = compile_speedup.measure(tiny_scenario(tiny_file), "cpu", 3, 0.2, 60, factory)
    assert {
        "scenario",
        "file",
        "mode",
        "world_size",
        "status",
        "steps_per_block",
        "tokens_per_step",
        "eager_block_s",
        "compiled_block_s",
        "speedup",
        "tokens_per_s_median",
        "ready_s",
        "compile_s",
        "probe_losses",
        "probe_loss_rel_diff",
        "last_block_losses",
        "last_block_loss_max_rel_diff",
    } <= set(row)
    assert row["speedup"]["median"] == pytest.approx(2.0) and len(row["eager_block_s"]) == 3
    assert [s.run.compile for _, s in started] == [False, True]
    assert "| tiny-variants | 1 | x2.000 |" in compile_speedup.render([row])


def test_a_plan_scenario_is_skipped_without_a_worker():
    plan = load_scenario(SCENARIOS_DIR / "olmo-core3" / "moe-128e-47b.yaml")  # the ci suite's plan scenario
    row, order, started = fake_measure(plan, {}, ["b", "x"])
    assert row["status"] == "skipped" and order == started == []
    assert "skipped" in variants.render([row])


class DriftingSide(FakeSide):
    """The machine slows down pair after pair (both blocks of a pair alike), after the 6 blocks of
    probing and settling of three workers."""

    def block(self, steps):
        pair = max(0, len(self.order) - 6) // 2
        return super().block(steps) * (1.0 + 0.5 * pair)


def test_each_ratio_takes_the_base_block_of_its_own_pair_on_a_drifting_machine(tiny_file):
    order, started = [], []
    factory = lambda *args: DriftingSide({"b": 0.01, "x": 0.02, "y": 0.005}, order, started, *args)
    row = variants.measure(
        tiny_scenario(tiny_file),
        Variant("b"),
        [Variant("x"), Variant("y")],
        "cpu",
        5,
        0.5,
        60,
        factory,
    )
    assert row["ratios"]["x"]["per_pair"] == pytest.approx([0.5] * 5)
    assert row["ratios"]["y"]["per_pair"] == pytest.approx([2.0] * 5)
    assert row["ratios"]["x"]["interval_95"] == pytest.approx([0.5, 0.5])


class DyingSide(FakeSide):
    def block(self, steps):
        if self.label == "x" and len(self.order) > 6:
            raise resident.WorkerDied("x worker exited with code -9: planted")
        return super().block(steps)


def test_a_worker_that_dies_fails_the_scenario_and_every_worker_is_closed(tiny_file):
    order, started = [], []
    factory = lambda *args: DyingSide({"b": 0.01, "x": 0.01, "y": 0.01}, order, started, *args)
    row = variants.measure(
        tiny_scenario(tiny_file),
        Variant("b"),
        [Variant("x"), Variant("y")],
        "cpu",
        4,
        0.1,
        60,
        factory,
    )
    assert row["status"] == "failed" and "planted" in row["error"] and set(row["ready_s"]) == {"b", "x", "y"}
    assert sorted(x for x in order if x.startswith("closed")) == ["closed b", "closed x", "closed y"]
    assert "failed: x worker exited" in variants.render([row])


def test_the_recompute_tool_measures_every_mode_and_an_identical_control(tiny_file, tmp_path, monkeypatch):
    calls = []

    def fake(scenario, base, chosen, device, pairs, block_s, timeout_s):
        calls.append((base, chosen))
        names = [v.name for v in chosen]
        ratio = {
            "per_pair": [1.0, 1.0],
            "median": 1.0,
            "min": 1.0,
            "max": 1.0,
            "quartiles": [1.0, 1.0],
            "hodges_lehmann": 1.0,
            "interval_95": [0.97, 1.03],
        }
        return {
            "scenario": scenario.name,
            "status": "ok",
            "world_size": 1,
            "base": base.name,
            "variants": names,
            "ratios": {n: ratio for n in names},
            "peak_rss_mib": None,
        }

    monkeypatch.setattr(variants, "measure", fake)
    out = tmp_path / "rc.json"
    assert recompute_cost.main([str(tiny_file), "--out", str(out)]) == 0
    ((base, chosen),) = calls
    assert base.patch == {"recompute": {"mode": "none", "parts": []}}
    assert [v.name for v in chosen] == [
        "full",
        "selective-attention",
        "selective-experts",
        "selective-norms",
        "selective-attention-experts",
        "none-again",
    ]
    assert chosen[-1].patch == base.patch  # the A/A control is the base once more
    assert [v.patch["recompute"] for v in chosen[:-1]] == [
        {"mode": "full", "parts": []},
        {"mode": "selective", "parts": ["attention"]},
        {"mode": "selective", "parts": ["experts"]},
        {"mode": "selective", "parts": ["norms"]},
        {"mode": "selective", "parts": ["attention", "experts"]},
    ]
    document = json.loads(out.read_text())
    assert "none-again (A/A control) vs none" in document["table"]
    assert "tiny-variants x1.000 [0.970, 1.030]" in document["control_note"]


# --- one real run -------------------------------------------------------------------------------
