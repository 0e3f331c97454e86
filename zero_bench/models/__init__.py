"""What the model is (one description) and how megatron-core builds it.

description.py: ModelConfig, the one description a preset or a Hugging Face config.json becomes,
and the parameter list of one tensor-parallel rank derived from it (param_numels), so the estimate
counts exactly what the built model holds. megatron.py: that description -> megatron-core's
GPTModel (local layer spec), the CPU shims it needs, recompute.
"""
from zero_bench.models.description import ModelConfig, param_numels

__all__ = ["ModelConfig", "param_numels"]
