"""models/stages.py's split of the layers into pipeline stages: which layers each rank builds, held to
megatron-core's own get_num_layers_to_build / get_transformer_layer_offset (what GPTModel builds at
each stage), and torch's looped placement of virtual stages (stage k x pp + r on pipeline rank r)."""
from __future__ import annotations

import pytest

from zero_bench.models.stages import Chunk, chunks, pipeline_config


def test_pp2_splits_four_layers_in_halves():
    assert chunks(4, 2, 1, 0) == [Chunk(stage=0, vp_stage=0, first=0, layers=2, pre=True, post=False)]
    assert chunks(4, 2, 1, 1) == [Chunk(stage=1, vp_stage=0, first=2, layers=2, pre=False, post=True)]


def test_interleaved_stages_loop_over_the_ranks():
    # megatron's docstring example: 8 layers, 2 stages, 2 virtual stages: [0, 1] [4, 5] and [2, 3] [6, 7]
    r0, r1 = chunks(8, 2, 2, 0), chunks(8, 2, 2, 1)
    assert [(c.stage, c.first, c.layers) for c in r0] == [(0, 0, 2), (2, 4, 2)]
    assert [(c.stage, c.first, c.layers) for c in r1] == [(1, 2, 2), (3, 6, 2)]
    assert [c.pre for c in r0 + r1] == [True, False, False, False]
    assert [c.post for c in r0 + r1] == [False, False, False, True]


@pytest.mark.parametrize("layers,pp,vpp", [(4, 2, 1), (4, 4, 1), (8, 2, 2), (12, 3, 2), (32, 4, 4), (80, 4, 1)])
def test_every_layer_built_once_and_as_megatron_places_it(layers, pp, vpp):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    import torch

    base = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                             pipeline_dtype=torch.float32, pipeline_model_parallel_size=pp)
    config = pipeline_config(base, pp, vpp)
    built = []
    for r in range(pp):
        for c in chunks(layers, pp, vpp, r):
            vp = c.vp_stage if vpp > 1 else None
            assert c.layers == get_num_layers_to_build(config, vp_stage=vp, pp_rank=r)
            assert c.first == get_transformer_layer_offset(config, vp_stage=vp, pp_rank=r)
            built += range(c.first, c.first + c.layers)
    assert sorted(built) == list(range(layers))
