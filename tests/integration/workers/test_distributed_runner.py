"""moe-bench run with multi-rank layouts: torchrun launch, gathered metrics, dead and hung ranks."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from own_processes import owned_processes_after, owner_env
from scenario_files import variant, write_scenario

from bench.cli import main
from bench.results import REPO_ROOT, load_results

pytestmark = pytest.mark.slow

# fp32, learned routing, no balance loss: every layout computes the same function (see
# tests/integration/distributed/test_trainer.py), so the losses a run records must not depend on the layout.
EXACT = dict(
    precision="fp32",
    routing={"mode": "learned", "seed": 3},
    model__moe__aux_loss_weight=0.0,
    run__steps=3,
    run__tokens_per_step=256,
)
LAYOUTS = {
    "single": {},
    "dp2-ep2-no-sync": {"dp": 2, "ep": 2, "dispatch": "no-sync", "capacity_factor": 2.0},
    "pp2-1f1b": {"pp": 2, "schedule": "1f1b", "microbatches": 2},
    "dp2-zero1": {"dp": 2, "optimizer_sharding": "zero1"},
}


def run(tmp_path: Path, scenarios: dict[str, dict], env: dict[str, str] | None = None):
    files = [str(write_scenario(tmp_path, name, data)) for name, data in scenarios.items()]
    out = tmp_path / "results"
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        code = main(["run", *files, "--out", str(out), "--device", "cpu"])
    finally:
        os.environ.clear()
        os.environ.update(old)
    return code, {d.name: d for d in load_results(out)} if out.exists() else {}


def test_recorded_losses_agree_across_layouts(tmp_path):
    code, docs = run(tmp_path, {name: variant(**EXACT, parallel=layout) for name, layout in LAYOUTS.items()})
    assert code == 0, {n: d.data["error"] for n, d in docs.items()}
    reference = docs["single"].data["details"]["losses"]
    assert len(reference) == 3
    for name in LAYOUTS:
        losses = docs[name].data["details"]["losses"]
        assert losses == pytest.approx(reference, rel=1e-5), name

    doc = docs["dp2-ep2-no-sync"]
    per_rank = doc.data["details"]["per_rank"]
    assert [r["rank"] for r in per_rank] == [0, 1] and [r["ep_rank"] for r in per_rank] == [0, 1]
    assert all(r["peak_tensor_bytes"] > 0 and r["optimizer_state_bytes"] > 0 for r in per_rank)
    assert doc.metrics["peak_tensor_bytes"]["median"] == max(r["peak_tensor_bytes"] for r in per_rank)
    assert doc.metrics["dropped_tokens"]["median"] == 0  # capacity factor 2 = ep: nothing can drop
    # ZeRO-1 holds half of the optimizer state of plain data parallelism... of the same model.
    zero1 = docs["dp2-zero1"].metrics["optimizer_state_bytes"]["median"]
    single = docs["single"].metrics["optimizer_state_bytes"]["median"]
    assert zero1 == pytest.approx(single / 2, rel=0.01)


def comparison_twins() -> list[Path]:
    """The multi-rank CPU twins of the reference release's comparisons (scenarios/smoke). The MXFP8 twin
    is left out: its quantisation blocks follow the tokens a rank holds, so no layout repeats a single
    rank's losses exactly; its layout is the bf16 twin's (e8-ep2-nosync-bf16)."""
    from bench.report.comparisons import load_comparisons
    from bench.scenario import SCENARIOS_DIR, load_scenario

    names = sorted({name for c in load_comparisons() for pair in c.pairs for name in pair})
    files = [SCENARIOS_DIR / "smoke" / f"{name}.yaml" for name in names]
    return [
        f for f in files if f.exists() and load_scenario(f).world_size > 1 and load_scenario(f).precision != "mxfp8"
    ]


def exact_twin(path: Path, single: bool = False) -> dict:
    """The smoke file as a function every layout computes alike (fp32, learned routing, no balance loss,
    a capacity no routing can overflow), in its own layout or (``single``) on one rank."""
    import yaml

    data = yaml.safe_load(path.read_text())
    data.pop("description", None)
    data.update(precision="fp32", routing={"mode": "learned", "seed": 3})
    data["model"]["moe"]["aux_loss_weight"] = 0.0
    # One update between the two measured steps: the second loss checks the gradients and the optimizer.
    data["run"].update(warmup_steps=0, steps=2, timeout_s=120)
    parallel = {} if single else dict(data.get("parallel", {}))
    if parallel.get("ep", 1) > 1:
        parallel["capacity_factor"] = float(parallel["ep"])  # a rank can receive every token: none dropped
    data["parallel"] = parallel
    return data


def test_the_comparison_twins_record_the_single_rank_losses_and_gradient_norms(tmp_path):
    twins = comparison_twins()
    # The layouts of the node scenarios, each in its CPU twin.
    assert {p.stem for p in twins} >= {
        "e8-ep2-nosync-bf16",
        "e8-ep2-sync-bf16",
        "e8-dp2-fsdp-bf16",
        "e8-ep2-nosync-zero1-bf16",
        "e8-pp2-ep2-bf16",
        "e128-ep2-nosync-bf16",
    }
    references: dict[str, str] = {}  # a single-rank scenario (as JSON) -> its name: one run per model
    scenarios, reference_of = {}, {}
    for path in twins:
        single = exact_twin(path, single=True)
        reference_of[path.stem] = references.setdefault(json.dumps(single, sort_keys=True), f"single-{len(references)}")
        scenarios[reference_of[path.stem]] = single
        scenarios[f"{path.stem}-fp32"] = exact_twin(path)
    assert len(references) == 2  # the 8-expert model and the 128-expert one
    code, docs = run(tmp_path, scenarios)
    assert code == 0, {n: d.data["error"] for n, d in docs.items() if d.status != "ok"}
    mismatched = {}
    for path in twins:
        twin, reference = docs[f"{path.stem}-fp32"], docs[reference_of[path.stem]]
        assert len(reference.data["details"]["losses"]) == 2
        losses, norms = twin.data["details"]["losses"], twin.metrics["grad_norm"]["samples"]
        # The global gradient norm of each step: Adam is blind to a gradient's scale, the norm is not. The
        # tolerance is fp32's: the data-parallel optimizer takes one norm of each flat fp32 bucket (about
        # 1e6 elements), FSDP one per parameter; on this model the two are 7e-5 apart. An expert gradient
        # off by the ep factor moves the 8-expert model's norm by 0.6%.
        if (
            losses != pytest.approx(reference.data["details"]["losses"], rel=1e-5)
            or norms != pytest.approx(reference.metrics["grad_norm"]["samples"], rel=2e-4)
            or twin.metrics["dropped_tokens"]["median"] != 0
        ):
            mismatched[path.stem] = {
                "losses": losses,
                "grad_norms": norms,
                "reference": (reference.data["details"]["losses"], reference.metrics["grad_norm"]["samples"]),
                "dropped": twin.metrics["dropped_tokens"]["median"],
            }
    assert not mismatched


FAULT = """
import os, signal, threading, time

def _fault():
    time.sleep(float(os.environ["MOE_TEST_FAULT_AFTER"]))
    if os.environ["MOE_TEST_FAULT"] == "die":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGSTOP)

if os.environ.get("RANK") == "1" and os.environ.get("MOE_TEST_FAULT"):
    threading.Thread(target=_fault, daemon=True).start()
"""


@pytest.mark.parametrize("fault,status", [("die", "failed"), ("hang", "timeout")])
def test_dead_or_hung_rank_ends_the_scenario_and_the_suite_goes_on(tmp_path, fault, status):
    # Rank 1 of the torchrun launch exits, or stops forever, a few seconds into the run.
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(textwrap.dedent(FAULT))
    env = {
        "PYTHONPATH": os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")]),
        "MOE_TEST_FAULT": fault,
        "MOE_TEST_FAULT_AFTER": "6",
        **owner_env(),  # marks the processes this test starts: only those are looked for
    }
    long_run = variant(parallel={"dp": 2}, run__steps=100000, run__timeout_s=25)
    single = variant()
    code, docs = run(tmp_path, {"victim": long_run, "after": single}, env)
    assert code == 1
    # A dead rank ends the run as failed, before its timeout (it would end as timeout otherwise); a
    # hung one at its timeout. Either way the next scenario runs.
    assert docs["victim"].status == status, docs["victim"].data["error"]
    assert docs["victim"].data["metrics"] == {}
    assert docs["after"].status == "ok"
    assert owned_processes_after(env) == [], "every rank process is gone"


def test_run_inside_an_existing_torchrun_launch(tmp_path):
    import subprocess
    import sys

    two = write_scenario(tmp_path, "two-ranks", variant(**EXACT, parallel={"dp": 2}))
    one = write_scenario(tmp_path, "one-rank", variant(**EXACT))
    out = tmp_path / "results"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "bench.cli",
        "run",
        str(two),
        str(one),
        "--out",
        str(out),
        "--device",
        "cpu",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    docs = {d.name: d for d in load_results(out)}
    assert set(docs) == {"two-ranks", "one-rank"}, "rank 0 writes each result once"
    assert len(list(out.rglob("*.json"))) == 2
    assert docs["two-ranks"].status == "ok"
    assert [r["rank"] for r in docs["two-ranks"].data["details"]["per_rank"]] == [0, 1]
    assert docs["one-rank"].status == "skipped"
    assert "needs 1 ranks (dp * pp) but this torchrun launch has 2" in docs["one-rank"].data["error"]
