"""What the model is (one description) and how megatron-core builds it. A new model family
touches this package only; everything downstream reads the description.

description.py  ModelConfig: the one description a preset or a Hugging Face config.json becomes
params.py       its parameter list per tensor-parallel rank: name, shape, tp split, FSDP2 group,
                and every count summed from it (num_params, params_per_shard, active_params ...)
flops.py        training FLOPs per sequence (MFU / HFU numerators; zero_bench.devices.metrics divides)
hf.py           a local config.json (llama, mistral, qwen2) -> the description's keys
megatron.py     the description -> megatron-core's TransformerConfig and GPTModel (local spec)
sdpa.py         torch's scaled_dot_product_attention as megatron's core attention
loss.py         the loss as a training loop builds it from the logits (megatron's, torch's, chunked)
shims.py        what megatron-core needs on CPU (buffers, RoPE, causal mask, RNG streams, recompute)
op_recompute.py recompute=op: torchtitan's per-op selective checkpointing of each layer
qk_norm.py      Qwen3's query / key RMSNorm per head, in megatron's layer
compiled.py     compile=true: what makes every rank compile the same graphs of megatron's model
sequence.py     long sequences: tiled_mlp (DeepSpeed's TiledMLP over megatron's MLP), recompute_offload
ulysses.py      parallel.sp: Ulysses' process groups, megatron's core attention inside DeepSpeed's
                DistributedAttention, RoPE at each rank's token offset, MoE load-balancing over the sequence
stages.py       parallel.pp: the layers of a rank's pipeline stages (megatron's split), each stage a
                GPTModel with pre_process / post_process, its weights pp = 1's
sequence_parallel.py  megatron's sequence parallelism at tp > 1: norms and biases whose gradients
                are summed over the tp group (megatron's own norms refuse it without Apex / TE)
The activation bytes per sample, which also depend on precision, recompute and device, are
zero_bench/estimate/activations.py's, from the same description.
"""
from zero_bench.models.description import Activation, Attention, ModelConfig, Normalization, PositionEmbedding
from zero_bench.models.params import param_numels

__all__ = ["Activation", "Attention", "ModelConfig", "Normalization", "PositionEmbedding", "param_numels"]
