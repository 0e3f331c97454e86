"""The typed records of a time prediction: one TimeTerm per cause, and the TimePrediction of one
configuration at one micro-batch that adds them up."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional


@dataclass(frozen=True)
class TimeTerm:
    """Seconds one cause adds to (exposed) or hides behind compute in (not exposed) one optimizer step."""
    name: str
    seconds: float
    exposed: bool
    """True: on the step's critical path; False: overlapped with compute (the step pays only what the
    overlapped terms together exceed the compute by: the 'communication beyond compute' term)."""
    source: str
    """Where the bytes, FLOPs or rate come from (a code path, a formula, a published figure)."""


@dataclass(frozen=True)
class TimePrediction:
    """One rank's optimizer step (grad_accum micro-steps) at one micro-batch, predicted."""
    terms: tuple[TimeTerm, ...]
    step_s: float
    """The exposed terms' sum: predicted time/it."""
    tokens_per_s_per_device: float
    mfu: Optional[float]
    """Model FLOPs (models/flops.py, no recompute) per second over the devices' peak (metrics.PEAK_FLOPS);
    None where no peak is known."""
    micro: int
    grad_accum: int
    rates: str = ""
    """Which hardware's rates it was computed with."""

    @property
    def dominant(self) -> TimeTerm:
        """The exposed term that costs the most."""
        return max((t for t in self.terms if t.exposed), key=lambda t: t.seconds)

    def term(self, name: str) -> TimeTerm:
        """The term called `name` (KeyError where there is none)."""
        for t in self.terms:
            if t.name == name:
                return t
        raise KeyError(name)

    def seconds(self, prefix: str) -> float:
        """The seconds of every term whose name starts with `prefix`."""
        return sum(t.seconds for t in self.terms if t.name.startswith(prefix))

    def cost_per_million_tokens(self, price_per_device_hour: float) -> float:
        """What 1M tokens cost on these devices at a price per device-hour."""
        return price_per_device_hour / (self.tokens_per_s_per_device * 3600) * 1e6

    def to_dict(self) -> dict:
        return {"micro": self.micro, "grad_accum": self.grad_accum, "step_s": self.step_s,
                "tokens_per_s_per_device": self.tokens_per_s_per_device, "mfu": self.mfu, "rates": self.rates,
                "dominant": self.dominant.name, "terms": [asdict(t) for t in self.terms]}
