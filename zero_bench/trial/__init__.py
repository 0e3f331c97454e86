"""A trial's processes: the runner launches ranks (or forks them from a search's pool), samples
their memory beside them, and turns what they wrote into one TrialResult per batch size.

Runner side:
  launch.py       one trial's ranks: start, watch (time limits), end, results
  launcher.py     the deepspeed launcher's command line and environment, killing the whole tree
  pool.py         ranks started once per search, a fresh forked child per trial
  sampler.py      per-rank RSS / per-GPU NVML every 50 ms beside the ranks
  outcome.py      the ranks' records -> one outcome per batch size (pure)
  time_limits.py  how long a trial may go without progress, from the speed measured
  machine.py      one zero_bench at a time per machine; no shared memory left behind
  swap.py         NVMe offload's swap folder per launch: its disk bytes sampled, removed, swept after a kill
Rank side:
  rank.py         `python -m zero_bench.trial.rank`: one trial, or a pool's rank
  pool_rank.py    a pooled rank: forks a fresh child per trial
  worker.py       the plan's batch sizes on one engine, each ending in a RankRecord
  oom.py          what an allocation failure looks like, on both sides
  faults.py       test-only faults injected into a real trial
"""
