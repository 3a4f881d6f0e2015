"""How a proxy runs one rank at CPU scale: the scenario as the proxy runs it (``run_spec``) and its
``ProxyScale`` against the scenario's own sizes (rules in ``bench.run.proxy.run``'s docstring, "What runs")."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from bench.scenario import Scenario
from bench.scenario_sections import CpuScale
from moe_engine.parallel.layout import Layout, stage_layers


@dataclass(frozen=True)
class ProxyScale:
    """What the proxy runs against what the scenario describes, for the replayed rank."""

    rank: int
    """Global rank replayed."""
    pp_rank: int
    """Its pipeline rank."""
    blocks_run: int
    """Transformer blocks of its stage that the proxy builds."""
    blocks_full: int
    """Blocks of its stage in the scenario."""
    seq_len_run: int
    """Tokens per sequence in the run."""
    tokens_per_microbatch_run: int
    """Tokens per microbatch on the rank, in the run."""
    tokens_per_microbatch_full: int
    """Tokens per microbatch on the rank, in the scenario."""
    microbatches_run: int
    """Microbatches per step in the run."""
    microbatches_full: int
    """Microbatches per step in the scenario."""

    @property
    def block_ratio(self) -> float:
        return self.blocks_full / self.blocks_run

    @property
    def token_ratio(self) -> float:
        return self.tokens_per_microbatch_full / self.tokens_per_microbatch_run


def run_spec(scenario: Scenario, device: torch.device) -> tuple[dict[str, Any], ProxyScale]:
    """The scenario as the proxy runs it (scaled on CPU), and the scale against the original."""
    spec = copy.deepcopy(scenario.spec)
    proxy, par = scenario.proxy, scenario.parallel_config
    if proxy is None:
        raise ValueError(f"{scenario.name}: not a proxy scenario (mode {scenario.spec['mode']}), no rank to replay")
    pp_rank = Layout(par).coords(proxy.rank).pp_rank
    seq_len, pp, dp = scenario.model.seq_len, par.pp, par.dp
    blocks_full = len(stage_layers(scenario.model.n_layers, pp)[pp_rank])
    m_full = par.microbatches
    assert m_full is not None  # ParallelConfig.__post_init__ resolves None to pp
    sequences_full = scenario.run.tokens_per_step // seq_len // dp // m_full
    scale = proxy.cpu_scale if device.type == "cpu" else CpuScale()

    blocks = min(scale.blocks or blocks_full, blocks_full)
    if blocks < blocks_full:
        spec["model"]["n_layers"] = pp * blocks
    seq_len_run = scale.seq_len or seq_len
    spec["model"]["seq_len"] = seq_len_run
    sequences = scale.sequences_per_microbatch or sequences_full
    if scale.microbatches:
        m_run = min(scale.microbatches, m_full)
    elif proxy.microbatches:
        m_run = min(proxy.microbatches, m_full)
    elif pp > 1:
        in_flight = m_full if par.schedule == "gpipe" else min(m_full, pp - pp_rank)
        m_run = max(min(2, m_full), in_flight)
    else:
        m_run = min(2, m_full)
    spec["parallel"]["microbatches"] = m_run
    spec["run"]["tokens_per_step"] = dp * m_run * sequences * seq_len_run
    if scale.precision:
        spec["precision"] = scale.precision
    scale_record = ProxyScale(
        rank=proxy.rank,
        pp_rank=pp_rank,
        blocks_run=blocks,
        blocks_full=blocks_full,
        seq_len_run=seq_len_run,
        tokens_per_microbatch_run=sequences * seq_len_run,
        tokens_per_microbatch_full=sequences_full * seq_len,
        microbatches_run=m_run,
        microbatches_full=m_full,
    )
    return spec, scale_record
