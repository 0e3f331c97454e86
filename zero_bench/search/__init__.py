"""`zero_bench maxbatch` and `maxseq`: before any launch, then the search, then sweeps of many searches.

preflight.py  the config against this machine; what the estimate says cannot fit is refused
maxbatch.py   the search (maxbatch, maxseq): launches and the store, the boundary decided in fresh processes
boundary.py   the boundary procedure, pure: the next sizes, and when the evidence decides
dimension.py  what a size means: the micro-batch (maxbatch) or model.seq_len on a tp x sp grid (maxseq)
sweeps.py     Hydra multirun sweeps whose jobs run elsewhere (submitit: Slurm or local processes)
"""
