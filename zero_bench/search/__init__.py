"""`zero_bench maxbatch`: before any launch, then the search, then sweeps of many searches.

preflight.py  the config against this machine; what the estimate says cannot fit is refused
maxbatch.py   the largest micro-batch that fits, the boundary decided in fresh processes
sweeps.py     Hydra multirun sweeps whose jobs run elsewhere (submitit: Slurm or local processes)
"""
