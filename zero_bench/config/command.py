"""What a sub-command does with a trial's keys: the `search:` section (maxbatch, maxseq) and the
`report:` section, which config.schema.Config composes beside BenchConfig. Re-exported by config.schema."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zero_bench.config.choices import Strategy


@dataclass
class SearchConfig:
    """How `zero_bench maxbatch` and `zero_bench maxseq` search (the `search:` section); min, max and
    granularity are maxbatch's micro-batches, the seq_* keys maxseq's sequence lengths."""
    min: int = 1
    """Smallest micro-batch tried."""
    max: int = 4096
    """Largest micro-batch tried."""
    granularity: int = 1
    """The boundary is confirmed to this step: b fits and b + granularity does not, both fresh."""
    max_trials: int = 24
    """Trials one invocation may run (a resumed search gets a new allowance)."""
    strategy: Strategy = Strategy.fit
    """fit: grow by measured memory per sample; doubling: plain doubling + bisection."""
    multi: bool = True
    """Bracket with several ascending sizes per launch (the answer is still decided fresh)."""
    cpu_budget_gb: float = 0.75
    """Per-rank budget on CPU when hardware.memory_gb is null (host RAM would take hours)."""
    pool: bool = True
    """Start the ranks once per search and fork a fresh process per trial (zero_bench.trial.pool);
    false: a deepspeed launch per trial. Either way each trial's ranks are fresh processes."""
    seq_min: Optional[int] = None
    """maxseq: shortest model.seq_len tried; null: one step of the granularity."""
    seq_max: int = 1048576
    """maxseq: longest model.seq_len tried (1M tokens: the longest contexts fine-tuned in 2026)."""
    seq_granularity: Optional[int] = None
    """maxseq: the boundary is confirmed to this many tokens (s fits, s + this does not, both
    fresh); must be a multiple of tp x sp. null: tp x sp rounded up to a multiple of 256."""


@dataclass
class ReportConfig:
    """`zero_bench report` (the `report:` section)."""
    runs: Optional[str] = None
    """A store, a run or sweep directory, or a glob of stores; None: `store`."""
    out: str = "reports/zero_bench.xlsx"
    """The workbook; the .csv, .md and its charts are written beside it."""
    compare: Optional[str] = None
    """Another store (directory, glob) or report .xlsx to put side by side."""
    price_per_device_hour: Optional[float] = None
    """What one device (GPU, or CPU rank) costs per hour, in any currency; None: no cost columns."""
    train_tokens: Optional[float] = None
    """Tokens of a training run to size (e.g. 1e12): its time and, with a price, its cost; None: not shown."""
