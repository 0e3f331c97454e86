"""The long-sequence savers of models/sequence.py on megatron's model, run for real in this process
(one gloo rank, tp 1, fp32, no engine; shims.cpu_checkpoint is the checkpoint, as FSDP2's trials run
it): tiled_mlp (DeepSpeed's TiledMLP) gives the untiled loss and gradients and keeps none of the
MLP's intermediates, recompute_offload moves each checkpointed layer input to a host copy and back,
and the estimate's terms (estimate/activations.py tiles, offload) are the tensors measured here.
The 2-rank trials: tests/integration/test_long_sequence.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from zero_bench.config.schema import BenchConfig, HardwareConfig
from zero_bench.estimate.activations import activation_bytes_per_sample, layer_terms
from zero_bench.models import sequence
from zero_bench.models.megatron import build_gpt, transformer_config
from zero_bench.models.shims import cpu_checkpoint, install_cpu_shims, seed_cpu_rng

from conftest import model

SMALL = dataclasses.replace(model("llama-tiny"), num_layers=2, seq_len=96)
BATCH = 2


@pytest.fixture(scope="module", autouse=True)
def megatron_tp1(tmp_path_factory):
    from megatron.core import parallel_state, tensor_parallel

    store = tmp_path_factory.mktemp("pg") / "store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    install_cpu_shims()
    before = tensor_parallel.checkpoint
    yield
    tensor_parallel.checkpoint = before
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def build(m=SMALL, **kw):
    from megatron.core import tensor_parallel

    tensor_parallel.checkpoint = cpu_checkpoint  # what an engine installs before building
    seed_cpu_rng(1234)
    cfg = BenchConfig(model=m, hardware=HardwareConfig(device="cpu"), precision="fp32", **kw)
    return cfg, build_gpt(cfg, transformer_config(cfg, on_cpu=True), on_cpu=True)


def batch(m=SMALL):
    tok = torch.randint(0, m.vocab_size, (BATCH, m.seq_len + 1), generator=torch.Generator().manual_seed(5))
    return tok[:, :-1], torch.arange(m.seq_len).unsqueeze(0).expand(BATCH, -1), tok[:, 1:]


def step(gpt, state=None):
    if state is not None:
        gpt.load_state_dict(state)
    tok, pos, labels = batch()
    loss = gpt(tok, pos, None, labels=labels).float().mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in gpt.parameters()]


def worst(a: list, b: list) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference():
    _, gpt = build()
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in gpt.state_dict().items()}
    return state, step(gpt)


@pytest.mark.parametrize("tiles,recompute", [("4", "none"), ("7", "none"), ("auto", "full"), ("3", "selective")])
def test_tiled_mlp_gives_the_untiled_loss_and_gradients(reference, tiles, recompute):
    """7 tiles of 192 rows: torch.chunk makes 7 of 28 and a shorter last one; auto on 96 tokens of
    256 wide is one tile; under full recompute the tiles run inside torch's checkpoint."""
    state, (ref_loss, ref) = reference
    _, gpt = build(tiled_mlp=tiles, recompute=recompute)
    loss, grads = step(gpt, state)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert worst(grads, ref) < 1e-5


def test_effective_tiles_are_the_chunks_torch_makes():
    for rows in (1, 10, 96, 192, 1000):
        for tiles in (1, 3, 6, 7, 64, 5000):
            assert sequence.effective_tiles(rows, tiles) == len(torch.chunk(torch.empty(rows), min(tiles, rows)))
    assert sequence.mlp_tiles("auto", 16384, 256) == 64 and sequence.mlp_tiles(None, 16384, 256) == 0


def saved_bytes(gpt) -> int:
    """Bytes of the distinct activation storages the forward saves for backward (the pack hook sees
    each; the weights the linears save are the model's, not activations)."""
    seen: dict = {}
    weights = {p.untyped_storage().data_ptr() for p in gpt.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tok, pos, labels = batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gpt(tok, pos, None, labels=labels)
    return sum(seen.values())


def test_tiling_drops_the_mlp_intermediates_the_estimate_counts():
    """Measured tensor by tensor: what tiling removes from the forward's saved storages is, to the
    byte, the estimate's MLP term of every layer (SwiGLU, eager: 5 ffn per token)."""
    cfg, untiled = build()
    _, tiled = build(tiled_mlp="4")
    dropped = saved_bytes(untiled) - saved_bytes(tiled)
    m = SMALL
    want = m.num_layers * BATCH * m.seq_len * (layer_terms(m, 1, "fp32", "cpu")["mlp"]
                                               - layer_terms(m, 1, "fp32", "cpu", tiles=4)["mlp"])
    assert want > 0 and dropped == want
    est = {t: activation_bytes_per_sample(m, 1, "fp32", device="cpu", tiles=t) for t in (0, 4)}
    assert est[0]["saved"] - est[4]["saved"] == want // BATCH


def test_recompute_offload_moves_each_checkpointed_input_to_a_host_copy_and_back(reference, monkeypatch):
    """Where each checkpointed input lives: after the forward every chunk's input storage is empty and a
    host copy holds it (on CPU a second CPU tensor), as many bytes as the estimate's host term; after
    the backward each is back, and loss and gradients are recompute=full's."""
    state, (ref_loss, ref) = reference
    copies, inputs = [], []
    to_host, offload = sequence.to_host, sequence.offload

    def recorded_to_host(t):
        copies.append(to_host(t))
        return copies[-1]

    def recorded_offload(t):
        inputs.append(t)
        return offload(t)

    monkeypatch.setattr(sequence, "to_host", recorded_to_host)
    monkeypatch.setattr(sequence, "offload", recorded_offload)
    cfg, gpt = build(recompute="full", recompute_offload=True)
    gpt.load_state_dict(state)
    tok, pos, labels = batch()
    loss = gpt(tok, pos, None, labels=labels).float().mean()
    m = SMALL
    assert len(inputs) == m.num_layers  # recompute_layers 1: one checkpoint per layer
    assert all(t.numel() == 0 for t in inputs)  # the device keeps nothing of them
    assert all(c.device.type == "cpu" and c.shape == (m.seq_len, BATCH, m.hidden_size) for c in copies)
    est = activation_bytes_per_sample(m, 1, "fp32", "full", device="cpu", offload=True)
    plain = activation_bytes_per_sample(m, 1, "fp32", "full", device="cpu")
    assert sum(c.nbytes for c in copies) == BATCH * est["host"] == BATCH * plain["layers"]
    assert est["layers"] == 0 and est["saved"] == plain["saved"] - plain["layers"]
    loss.backward()
    assert all(t.shape == (m.seq_len, BATCH, m.hidden_size) for t in inputs)  # back before the recompute
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)
    assert worst([p.grad for p in gpt.parameters()], ref) < 1e-5


def test_offload_wraps_the_checkpoint_once():
    from megatron.core import tensor_parallel

    build(recompute="full", recompute_offload=True)
    build(recompute="full", recompute_offload=True)
    wrapped = tensor_parallel.checkpoint
    assert getattr(wrapped, sequence.OFFLOADED) and not getattr(wrapped.__wrapped__, sequence.OFFLOADED, False)
