"""torch.compile on megatron's GPT (compile=true): what every rank must share for its compiled graphs
to be the same graphs. Both engines call `same_graphs_on_every_rank` before they compile.

megatron-core 0.16.1 warns on rank 0 only, in the forward of every layer: utils.py
get_tensor_model_parallel_group_if_none runs `if torch.distributed.get_rank() == 0: warnings.warn(...)`
whenever a caller passes no tp_group (transformer_layer.py's attention does). Dynamo cannot trace
`warnings.warn` (a C builtin) and breaks the graph there - on rank 0 alone. The ranks then compile
different graphs, and a compiled backward hands its gradients to their AccumulateGrad nodes in its
own graph's output order, so the gradient hooks fire in another order on each rank. DeepSpeed's
ZeRO-1/2 fill their reduce buckets in the order the hooks fire (stage_1_and_2.py
reduce_independent_p_g_buckets_and_remove_grads): on GPT-mini the ranks' buckets held different
parameters, and ZeRO-2's reduce aborted in gloo ("Received data size doesn't match expected size.
132224 vs 131456"); where the sizes happen to match, the ranks would sum different parameters'
gradients without a word. Listed in dynamo's ignore_logging_functions, the warning is dropped from
traced code (eager code still warns), and every rank traces one graph.
"""
from __future__ import annotations

import warnings


def same_graphs_on_every_rank() -> None:
    """Make dynamo trace through rank-dependent logging instead of breaking the graph on one rank."""
    import torch._dynamo

    torch._dynamo.config.ignore_logging_functions.add(warnings.warn)
