"""Scenario files: load YAML, validate against scenarios/schema.json, check the layout, build configs.

Every problem becomes a ``ScenarioError`` naming the file, the field path and the reason, raised
before any work starts.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from bench.predict.device import ProfileError, load_profile
from bench.results import REPO_ROOT
from bench.scenario_sections import ClusterConfig, ProxyConfig, RunConfig
from bench.units import GIB
from moe_engine.config import ModelConfig, OptimizerConfig, ParallelConfig, RecomputeConfig
from moe_engine.parallel.layout import check_proxy_layout, stage_blocks

SCENARIO_SCHEMA_PATH = REPO_ROOT / "scenarios" / "schema.json"
SCENARIOS_DIR = REPO_ROOT / "scenarios"


class ScenarioError(ValueError):
    """A scenario file that cannot run: ``<file>: <field path>: <reason>``."""

    def __init__(self, file: str | Path | None, path: str, reason: str):
        self.file, self.field_path, self.reason = str(file) if file else "<scenario>", path, reason
        super().__init__(f"{self.file}: {path or '(top level)'}: {reason}")


@dataclass
class Scenario:
    """A validated scenario with its defaults filled in."""

    name: str
    """Scenario name (file stem unless the file sets one)."""
    file: Path | None
    """Where it was loaded from."""
    spec: dict[str, Any]
    """The scenario as run: the file's content with every default filled in."""
    model: ModelConfig
    """Engine config, with the scenario's routing and precision applied."""
    parallel_config: ParallelConfig
    """Engine layout config."""
    recompute: RecomputeConfig
    """Activation recompute of the blocks."""
    run: RunConfig
    """Steps, their size and the worker's time limit."""
    cluster: ClusterConfig | None
    """The target cluster; None when the scenario has no ``cluster`` section (an execute scenario may leave it out)."""
    proxy: ProxyConfig | None
    """The rank a proxy scenario replays and its CPU scale-down; None unless the mode is proxy."""

    @property
    def mode(self) -> str:
        return self.spec["mode"]

    @property
    def precision(self) -> str:
        return self.spec["precision"]

    @property
    def parallel(self) -> dict[str, Any]:
        return self.spec["parallel"]

    @property
    def world_size(self) -> int:
        return self.parallel_config.world_size

    @property
    def optimizer(self) -> OptimizerConfig:
        """The engine's optimizer settings for this scenario (its clipping threshold)."""
        return OptimizerConfig(max_grad_norm=self.run.max_grad_norm)


def _schema() -> dict[str, Any]:
    return json.loads(SCENARIO_SCHEMA_PATH.read_text())


def _fill_defaults(instance: dict[str, Any], schema: dict[str, Any]) -> None:
    for key, sub in schema.get("properties", {}).items():
        if key not in instance and "default" in sub:
            instance[key] = copy.deepcopy(sub["default"])
        if key in instance and isinstance(instance[key], dict) and sub.get("type") == "object":
            _fill_defaults(instance[key], sub)


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ScenarioError(path, "", f"cannot read: {err.strerror or err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ScenarioError(path, "", f"not valid YAML: {where}{getattr(err, 'problem', None) or err}") from None
    return scenario_from_dict(data, file=path)


def scenario_from_dict(data: Any, file: str | Path | None = None) -> Scenario:
    if not isinstance(data, dict):
        raise ScenarioError(file, "", "a scenario must be a mapping")
    schema = _schema()
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(data), key=lambda e: (len(e.path), str(e.path)))
    if errors:
        err = errors[0]
        raise ScenarioError(file, ".".join(str(p) for p in err.absolute_path), err.message)

    spec = copy.deepcopy(data)
    spec.setdefault("name", Path(file).stem if file else "scenario")
    for section in ("routing", "parallel", "recompute", "run"):
        spec.setdefault(section, {})
    spec.setdefault("precision", schema["properties"]["precision"]["default"])
    if spec.get("cluster", {}).get("device"):
        # Before the defaults: the device's network, not the schema's, fills what the file leaves out.
        _apply_device(spec["cluster"], file)
    _fill_defaults(spec, schema)
    if spec.get("cluster"):
        _fill_defaults(spec["cluster"], schema["properties"]["cluster"])
    if spec.get("checkpoint"):
        if spec["mode"] != "execute":
            raise ScenarioError(
                file, "checkpoint", f"only an execute scenario saves checkpoints (mode is {spec['mode']})"
            )
        _fill_defaults(spec["checkpoint"], schema["properties"]["checkpoint"])
    if spec["mode"] == "proxy":
        spec.setdefault("proxy", {})
        _fill_defaults(spec["proxy"], schema["properties"]["proxy"])
        spec["proxy"].setdefault("cpu_scale", {})
        _fill_defaults(spec["proxy"]["cpu_scale"], schema["properties"]["proxy"]["properties"]["cpu_scale"])

    model = _model_config(spec, file)
    spec["run"].setdefault("tokens_per_step", 4 * model.seq_len)
    # Every default is in place: the typed sections are built once, here.
    run = RunConfig.from_dict(spec["run"])
    cluster = ClusterConfig.from_dict(spec["cluster"]) if spec.get("cluster") else None
    proxy = ProxyConfig.from_dict(spec["proxy"]) if spec["mode"] == "proxy" else None
    parallel = _parallel_config(spec, model, run, file)
    recompute = _recompute_config(spec, model, parallel, file)
    _check_cluster(cluster, parallel, file)
    if proxy is not None:
        _check_proxy(spec, proxy, parallel, file)
    return Scenario(
        name=spec["name"],
        file=Path(file) if file else None,
        spec=spec,
        model=model,
        parallel_config=parallel,
        recompute=recompute,
        run=run,
        cluster=cluster,
        proxy=proxy,
    )


def _model_config(spec: dict[str, Any], file) -> ModelConfig:
    model = copy.deepcopy(spec["model"])
    routing = spec["routing"]
    model["moe"].update(routing=routing["mode"], routing_seed=routing["seed"], zipf_exponent=routing["zipf_exponent"])
    if spec["precision"] in ("mxfp8", "fp8"):
        # bf16 parameters and dense compute (fp32 masters, fp32 router); the experts run MXFP8 or
        # rowwise FP8 GEMMs (the expert backend of the same name).
        precision = spec["precision"]
        backend = model["moe"].setdefault("backend", precision)
        if backend != precision:
            raise ScenarioError(
                file, "model.moe.backend", f"precision {precision} runs the {precision} expert backend, not {backend!r}"
            )
        model["dtype"] = "bf16"
    else:
        model["dtype"] = spec["precision"]
    try:
        return ModelConfig.from_dict(model)
    except ValueError as err:
        field, _, reason = str(err).partition(": ")
        if field in ("moe.routing", "moe.routing_seed", "moe.zipf_exponent"):
            field = "routing." + field.split(".")[1].replace("routing_", "")
        elif field == "dtype":
            field = "precision"
        else:
            field = "model." + field
        raise ScenarioError(file, field, reason) from None


def _parallel_config(spec: dict[str, Any], model: ModelConfig, run: RunConfig, file) -> ParallelConfig:
    """The layout, checked against the model and (execute) against what the engine runs; its batch split.

    A microbatch count left at null becomes the config's default (pp) in ``spec``, so the scenario as
    run, and its hash, name the count that ran.
    """
    defaulted = spec["parallel"].get("microbatches") is None
    try:
        parallel = ParallelConfig.from_dict(spec["parallel"])
        parallel.validate(model)
        if parallel.a2a_chunks > 1 and parallel.ep == 1:
            # Without expert parallelism there is no all-to-all to split.
            raise ValueError(f"parallel.a2a_chunks: needs ep > 1 (a2a_chunks={parallel.a2a_chunks}, ep=1)")
        if spec["mode"] == "execute":
            parallel.validate_executable()
        spec["parallel"]["microbatches"] = parallel.microbatches
        tokens = run.tokens_per_step
        if tokens % model.seq_len:
            raise ValueError(f"run.tokens_per_step: {tokens} is not a multiple of model.seq_len={model.seq_len}")
        parallel.validate_batch(tokens // model.seq_len, field="run.tokens_per_step")
    except ValueError as err:
        field, _, reason = str(err).partition(": ")
        if defaulted and field == "parallel.microbatches":
            reason += f" (parallel.microbatches is not set: it defaults to pp={spec['parallel'].get('pp', 1)})"
        raise ScenarioError(file, field, reason) from None
    return parallel


def _recompute_config(spec: dict[str, Any], model: ModelConfig, parallel: ParallelConfig, file) -> RecomputeConfig:
    """The recompute section, its block subset checked against the model and the smallest pipeline stage."""
    try:
        recompute = RecomputeConfig.from_dict(spec["recompute"])
        stages = stage_blocks(model.n_layers, parallel.num_stages)
        recompute.validate(model.n_layers, min(len(stage) for stage in stages))
    except ValueError as err:
        field, _, reason = str(err).partition(": ")
        raise ScenarioError(file, field, reason) from None
    return recompute


def _check_proxy(spec: dict[str, Any], proxy: ProxyConfig, parallel: ParallelConfig, file) -> None:
    rank = proxy.rank
    if rank >= parallel.world_size:
        raise ScenarioError(file, "proxy.rank", f"rank {rank} is outside the layout's {parallel.world_size} ranks")
    try:
        check_proxy_layout(parallel)
    except ValueError as err:
        field, _, reason = str(err).partition(": ")
        raise ScenarioError(file, field, reason) from None
    model = spec["model"]
    if proxy.cpu_scale.blocks and (model.get("n_dense_layers", 0) or model.get("moe_every", 1) > 1):
        # Fewer blocks would move the boundary between the dense and the MoE blocks, or their pattern.
        raise ScenarioError(
            file,
            "proxy.cpu_scale.blocks",
            "scaling the blocks needs a model without dense layers (n_dense_layers 0, moe_every 1)",
        )


def _apply_device(cluster: dict[str, Any], file) -> None:
    """Fill a cluster's memory, peak and network from its device profile; a given value must agree."""

    try:
        profile = load_profile(cluster["device"])
    except ProfileError as err:
        raise ScenarioError(file, "cluster.device", str(err)) from None
    implied = {
        "gpu_memory_gib": profile.memory_bytes / GIB,
        "peak_tflops": profile.peak_tflops["bf16"],
        **{key: profile.network[key] for key in ("gpus_per_node", "intra_node_gbps", "inter_node_gbps", "latency_us")},
    }
    for key, value in implied.items():
        if key in cluster and not math.isclose(cluster[key], value, rel_tol=1e-3):
            raise ScenarioError(
                file,
                f"cluster.{key}",
                f"{cluster[key]} contradicts device {profile.name} ({profile.file}: {value:g}); give one of them",
            )
        cluster.setdefault(key, value)


def _check_cluster(cluster: ClusterConfig | None, parallel: ParallelConfig, file) -> None:
    if cluster and cluster.gpus != parallel.world_size:
        raise ScenarioError(
            file, "cluster.gpus", f"{cluster.gpus} GPUs but the layout uses dp * pp = {parallel.world_size}"
        )
