"""Each engine's estimate returns one typed record (estimate/prediction.py Prediction), whose buffers
live only in phases the engine has: a buffer alive in a phase the engine does not name would be
counted nowhere, silently."""
from __future__ import annotations

import pytest

from zero_bench.config.configure import compose, from_cfg
from zero_bench.engines.specs import SPECS, load
from zero_bench.estimate import estimate
from zero_bench.estimate.prediction import Buffer, Phase, PhaseBytes, Prediction

CASES = [(engine, zero, device, extra) for engine, stages in (("deepspeed", (0, 1, 2, 3)), ("fsdp2", (2, 3)))
         for zero in stages for device in ("cpu", "gpu") for extra in ((), ("offload=true",), ("loss=chunked",))
         if not (zero == 0 and extra == ("offload=true",))]


def bench(engine: str, zero: int, device: str, extra: tuple):
    precision = "fp32" if device == "cpu" else "bf16"
    return from_cfg(compose(["model=gpt-tiny", f"hardware.device={device}", f"precision={precision}",
                             f"engine={engine}", f"zero={zero}", "parallel.dp=2", *extra]), here=False)


@pytest.mark.parametrize("engine,zero,device,extra", CASES)
def test_every_engine_returns_one_typed_prediction(engine, zero, device, extra):
    b = bench(engine, zero, device, extra)
    p = load(SPECS[engine].predict)(b, None)
    assert isinstance(p, Prediction) and p.phases
    assert all(isinstance(ph, Phase) and isinstance(v, PhaseBytes) for ph, v in p.phases.items())
    assert all(isinstance(x, Buffer) for x in p.buffers)
    assert len({x.name for x in p.buffers}) == len(p.buffers)
    for x in p.buffers:
        assert x.phases and set(x.phases) <= set(p.phases), (x.name, x.phases, list(p.phases))
    # the activations grow some phase, and the table's figure per sample is one of them
    assert p.act_per_sample in {v.per_sample for v in p.phases.values()} and p.act_per_sample > 0
    assert 0 <= p.phase_grads <= p.states.grads


def test_the_estimate_adds_up_its_prediction():
    e = estimate(bench("deepspeed", 2, "cpu", ()))
    p = e.prediction
    assert e.phase_bytes(Phase.bwd_end) == p.phases[Phase.bwd_end].grads + sum(
        x.bytes for x in p.buffers if Phase.bwd_end in x.phases)
    assert e.persistent == p.states.total - p.phase_grads  # on CPU the host is the device
    assert e.buffers_total == max(p.buffer_bytes(ph) for ph in p.phases)
    with pytest.raises(KeyError):
        p.buffer("no such buffer")
