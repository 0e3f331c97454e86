"""What a search grows until it no longer fits: the micro-batch (`zero_bench maxbatch`) or the
sequence (`zero_bench maxseq`). The boundary procedure (search/maxbatch.py: Known, next_plan,
verdict) is one for both: it sees integer sizes on a grid min, min + g, ... max. A `Grow` says what
a size means to a trial: which config runs it, which plan entry, how a stored trial's size is read
back, and the key its search is stored under.

maxseq's grid: the sequence must split evenly over tp (megatron's sequence parallelism) and sp
(Ulysses), so every size is a multiple of tp x sp; by default also of SEQ_STEP tokens. One size
per launch (`multi` off): the worker builds its model and batches for one model.seq_len, and with
the pool (search.pool) a fresh trial is a fork, about a second.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Iterable, Optional

from zero_bench.config.layout import RankLayout
from zero_bench.config.schema import BenchConfig, ConfigError, SearchConfig
from zero_bench.models.description import PositionEmbedding
from zero_bench.models.flops import hardware_flops_per_seq
from zero_bench.records import Dimension, Entry, TrialResult
from zero_bench.trial.time_limits import Pace, measured_pace

# The default step of maxseq's grid, in tokens: under 1 % of the 32K-1M contexts it is asked about
# (a finer answer costs a fresh trial per halving and is within the run-to-run noise of the peak),
# and a multiple of the 128-token tiles flash attention's kernels work in.
SEQ_STEP = 256


def with_seq_len(cfg: BenchConfig, seq_len: int) -> BenchConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seq_len=seq_len))


def seq_granularity(spec: SearchConfig, layout: RankLayout) -> int:
    """search.seq_granularity, or tp x sp rounded up to a multiple of SEQ_STEP; refused where it
    would not split the sequence over tp x sp."""
    need = layout.tp * layout.sp
    if spec.seq_granularity is None:
        return math.lcm(need, SEQ_STEP)
    if spec.seq_granularity % need:
        raise ConfigError(f"search.seq_granularity={spec.seq_granularity}: must be a multiple of tp x sp = {need} "
                          "(each rank of a tp x sp group holds an equal share of the sequence)")
    return spec.seq_granularity


def seq_grid(spec: SearchConfig, layout: RankLayout) -> SearchConfig:
    """The search keys maxseq's procedure runs on: min/max/granularity in tokens, one size a launch."""
    g = seq_granularity(spec, layout)
    lo = g if spec.seq_min is None else spec.seq_min
    if lo % (layout.tp * layout.sp):
        raise ConfigError(f"search.seq_min={lo}: must be a multiple of tp x sp = {layout.tp * layout.sp}")
    if spec.seq_max < lo:
        raise ConfigError(f"search.seq_max={spec.seq_max}: must be >= search.seq_min={lo}")
    return dataclasses.replace(spec, min=lo, max=spec.seq_max, granularity=g, multi=False)


def check_positions(cfg: BenchConfig, grid: SearchConfig) -> None:
    """Learned positions are a table of model.seq_len rows: a longer sequence has no position to
    look up (a model that learned 1,024 positions does not train at 4,096 without new rows), so the
    search's range must stay within it. RoPE has no table: past a checkpoint's
    max_position_embeddings it runs (models/hf.py warns once)."""
    m = cfg.model
    if m.position_embedding == PositionEmbedding.learned and grid.max > m.seq_len:
        raise ConfigError(f"search.seq_max={grid.max}: model.position_embedding=learned ({m.name}) has "
                          f"model.seq_len={m.seq_len} positions; maxseq searches up to the table "
                          f"(search.seq_max<={m.seq_len}) or a RoPE model")


def past_positions(cfg: BenchConfig, grid: SearchConfig) -> Optional[str]:
    """The one-line warning for a search whose range passes the positions a RoPE checkpoint
    (model.hf_config) was trained for: it runs, as a single trial that long does (models/hf.py)."""
    from zero_bench.models.hf import position_limit

    path = cfg.model.hf_config
    limit = position_limit(path) if path else None
    if limit is None or grid.max <= limit:
        return None
    return (f"search.seq_max={grid.max}: longer than max_position_embeddings={limit} of model.hf_config={path}; "
            "sequences past it are measured as asked")


@dataclass(frozen=True)
class Grow:
    """The dimension one search grows."""
    kind: Dimension = Dimension.BATCH

    @property
    def seq(self) -> bool:
        return self.kind == Dimension.SEQ

    @property
    def name(self) -> str:
        return "seq_len" if self.seq else "micro"

    def size(self, t: TrialResult) -> int:
        return int(t.config["model"]["seq_len"]) if self.seq else t.micro

    def config(self, cfg: BenchConfig, size: int) -> BenchConfig:
        return with_seq_len(cfg, size) if self.seq else cfg.with_micro(size)

    def entries(self, cfg: BenchConfig, plan: list[Entry]) -> list[Entry]:
        """The launch's plan: maxseq runs batch.micro at the one sequence length its config has."""
        return [Entry(cfg.batch.micro, e.mode) for e in plan] if self.seq else plan

    def key(self, cfg: BenchConfig) -> str:
        """maxbatch's key is the config's (everything but the micro-batch); maxseq's everything but
        model.seq_len, with batch.micro, and apart from any maxbatch key."""
        if not self.seq:
            return cfg.search_key()
        base = with_seq_len(cfg, 0).search_key()
        return "seq-" + hashlib.sha256(f"{base}/micro={cfg.batch.micro}".encode()).hexdigest()[:16]

    def pace(self, trials: Iterable[TrialResult], cfg: BenchConfig) -> Optional[Pace]:
        """Seconds per sample for the time limit of the next trial (`cfg`). A longer sequence's step
        takes longer: each measured pace is scaled by the FLOPs per sequence at `cfg`'s length over
        those at the trial's (attention's s^2 included)."""
        if not self.seq:
            return measured_pace(trials, cfg.batch.grad_accum)
        want, pace = self._flops(cfg, cfg.model.seq_len), None
        for t in trials:
            one = measured_pace([t], cfg.batch.grad_accum)
            if one is not None:
                scaled = one.s_per_sample * want / self._flops(cfg, self.size(t))
                pace = Pace(scaled, one.source).slower(pace)
        return pace

    @staticmethod
    def _flops(cfg: BenchConfig, seq_len: int) -> float:
        return hardware_flops_per_seq(dataclasses.replace(cfg.model, seq_len=seq_len), cfg.recompute,
                                      cfg.recompute_layers)
