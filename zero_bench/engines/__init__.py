"""What trains the model and shards its states: the engine. The worker runs its plan on an `Engine`
and does not know which library is behind it; each engine builds the model (models/), runs one
optimizer step, and counts its own exact model states.

deepspeed.py: DeepSpeed ZeRO 0-3, CPU offload, DeepSpeed's activation checkpointing.
storages.py: bytes per storage, each once: how engines count their states and the worker its live tensors.
fsdp2.py: PyTorch FSDP2 (fully_shard per layer and root; zero 2/3, bf16, CPU offload, megatron's recompute).
specs.py: each engine as the runner sees it (EngineSpec, registered by name in SPECS; no torch).
base.py: the Engine protocol and build_engine, by the registry.
refusals.py: what each engine cannot run, one line per key (its spec names it).
ds_config.py: the composed config -> the exact DeepSpeed JSON a DeepSpeed trial runs with.
pipeline.py: parallel.pp > 1, a rank's stages under torch's pipeline schedules (both engines' pipeline trainers).
This package imports nothing heavy itself, so that the runner can import specs.py. base.py imports
every registered engine in every rank, whichever runs: a pool's forked child and a freshly launched rank
then hold the same libraries (megatron-core imports torch's FSDP anyway; deepspeed adds ~21 MiB RSS),
so the engines' memory figures differ by what they do, not by what they import.
"""
