"""The answer in words: per model and device, which configuration to pick and why.

Fixed rules over the Details frame (nothing generated): among the configurations measured at
their max batch,
- largest batch: the highest Max Global BSZ (ties: the faster), compared with the baseline (lowest
  ZeRO stage, no offload, ...; the runner-up when the winner is the baseline);
- fastest: the most samples/s at its own max batch (ties: the larger batch), compared with the others;
- cheapest (with a price): the lowest cost per 1M tokens (ties: the faster), compared with the others.
Each is one sentence with its numbers. On a store with no GPU rows, where nothing measured says how a
configuration runs on the devices being chosen, two more rank every configuration with a max batch by
the time estimate (estimate/time/, the Details sheet's "(predicted)" columns), each figure named predicted:
- fastest (predicted): the most predicted samples/s at its max batch;
- cheapest (predicted, with a price): the lowest predicted cost per 1M tokens. maxseq's rows (`search` = maxseq) are judged apart, by one rule:
- longest sequence: the highest Max seq len (ties: the more tokens/s), compared with the others; the
  winner named with its long-sequence settings (sp degree, tiled MLP, checkpoint offload) wherever the
  report shows them, as an engineer planning a long fine-tune would set them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pandas as pd

from zero_bench.config.schema import DEFAULT_ENGINE
from zero_bench.engines.specs import SPECS
from zero_bench.report.costs import (COST_PER_HOUR, COST_PER_MTOK, COST_TO_TRAIN, DAYS_TO_TRAIN, PRED_COST_PER_MTOK,
                                     PRED_DAYS_TO_TRAIN, tokens_text)
from zero_bench.report.views import baseline_index

GROUP = ["Model", "num_layers", "hidden_size", "num_heads", "device"]
SPS, BSZ, SEQ, TPS = "Throughput (samples/sec)", "Max Global BSZ", "Max seq len", "tokens/s"
PRED_SPS, PRED_TIME, PRED_TERM = ("Throughput (samples/sec, predicted)", "time/it (ms, predicted)",
                                  "dominant term (predicted)")  # tables.PREDICTED_TIME_COLUMNS
# Keys that tell configurations of one group apart, and how a name shows each (ZeRO stage always).
NAMED = {"engine": lambda v: f"on {SPECS.get(v, SPECS[DEFAULT_ENGINE]).title}",
         "data parallel": lambda v: f"dp{v:g}", "model parallel": lambda v: f"tp{v:g}",
         "expert parallel": lambda v: f"ep{v:g}", "ZeRO++": lambda v: "" if v == "none" else f"+ ZeRO++ {v}",
         "CPU Offload": lambda v: {"No": "", "Yes": "+ offload", "NVMe": "+ NVMe offload"}.get(
             v, f"+ {'NVMe ' if v.startswith('NVMe') else ''}offload {v.split(' ', 1)[-1]}".strip()),
         "precision": str, "recompute": lambda v: f"recompute {v}", "compile": lambda v: "compiled" if v == "Yes" else
         "eager", "ds preset": str, "grad accum": lambda v: f"grad accum {v:g}",
         "sequence parallel": lambda v: f"sp{v:g}", "tiled MLP": lambda v: "" if v == "No" else _tiled(v),
         "checkpoint offload": lambda v: "checkpoint offload" if v == "Yes" else ""}
# the long-sequence keys (report/tables.py's columns, shown where some row uses them)
LONG = ("sequence parallel", "tiled MLP", "checkpoint offload")
UNITS = {"cpu": "CPU ranks", "gpu": "GPUs"}
WHY = {"estimated_oom": "does not fit, estimated", "does_not_fit": "does not fit", "oom": "out of memory",
       "cannot_initialize": "cannot initialize", "incomplete": "search incomplete"}
MOST_COMPARED = 3  # a sentence compares the winner with this many others at most


@dataclass(frozen=True)
class Pick:
    kind: str  # "largest batch", "fastest", "cheapest", or "only" / "none"
    config: str  # the configuration's label ("" for "none")
    sentence: str


@dataclass(frozen=True)
class Advice:
    heading: str  # model and device, e.g. "GPT-345M on 8 GPUs"
    picks: tuple[Pick, ...]
    unmeasured: str = ""  # configurations of the group without a measured max batch, one sentence


def recommend(details: pd.DataFrame, train_tokens: Optional[float] = None) -> list[Advice]:
    """One Advice per (model, device) group, in the frame's order."""
    if details.empty:
        return []
    groups = details.groupby([c for c in GROUP if c in details.columns], dropna=False, sort=False)
    no_gpu = "device" not in details.columns or not (details["device"].astype(str) == "gpu").any()
    out = []
    for _, g in groups:
        seq = g["search"] == "maxseq" if "search" in g.columns else pd.Series(False, index=g.index)
        if not seq.all():
            advice = _advice(g[~seq], train_tokens)
            if no_gpu:
                advice = Advice(advice.heading, advice.picks + predicted_picks(g[~seq], train_tokens), advice.unmeasured)
            out.append(advice)
        if seq.any():
            out.append(_seq_advice(g[seq]))
    return out


def _seq_advice(g: pd.DataFrame) -> Advice:
    """maxseq's rows of one group: the longest sequence, in one sentence."""
    ok = g[g[SEQ].notna()]
    names = config_names(g, unique_among=ok.index)
    failed = ", ".join(f"{names[i]} ({_why(g.at[i, 'status'])})" for i in g.index.difference(ok.index, sort=False))
    heading = _heading(g) + ", longest sequence"
    if ok.empty:
        return Advice(heading=heading, picks=(Pick("none", "", f"No configuration fitted a sequence: {failed}."),))
    return Advice(heading=heading, picks=(longest_seq(ok, names),),
                  unmeasured=f"Without a measured longest sequence: {failed}." if failed else "")


def _advice(g: pd.DataFrame, train_tokens: Optional[float]) -> Advice:
    ok = g[g[BSZ].notna() & g[SPS].notna()]
    names = config_names(g, unique_among=ok.index)
    failed = ", ".join(f"{names[i]} ({_why(g.at[i, 'status'])})" for i in g.index.difference(ok.index, sort=False))
    if ok.empty:
        return Advice(heading=_heading(g), picks=(Pick("none", "", f"No configuration fitted: {failed}."),))
    unmeasured = f"Without a measured max batch: {failed}." if failed else ""
    if len(ok) == 1:
        picks = (_only(ok.iloc[0], names[ok.index[0]]),)
    else:
        picks = (largest_batch(ok, names), fastest(ok, names, train_tokens))
        if COST_PER_MTOK in ok.columns and ok[COST_PER_MTOK].notna().any():
            picks += (cheapest(ok, names, train_tokens),)
        climb = ladder(ok, names)
        if climb is not None:
            picks += (climb,)
    return Advice(heading=_heading(g), picks=picks, unmeasured=unmeasured)


def _heading(g: pd.DataFrame) -> str:
    first = g.iloc[0]
    unit = UNITS.get(str(first.get("device", "")), "devices")
    n = g["# gpus"].dropna().unique() if "# gpus" in g else []
    return f"{first['Model']} on {int(n[0])} {unit}" if len(n) == 1 else f"{first['Model']} on {unit}"


def _why(status) -> str:
    return WHY.get(str(status), str(status).replace("_", " "))


def config_names(g: pd.DataFrame, unique_among=None, keys: dict = NAMED) -> dict:
    """Index -> a short name: "ZeRO-<stage>" plus each of `keys` that varies within the group; the
    full labels where two of `unique_among` (default: all) would share a name."""
    varying = [k for k in keys if k in g.columns and g[k].nunique(dropna=False) > 1]
    names = {}
    for i, row in g.iterrows():
        stage = row.get("ZeRO Stage")
        parts = [f"ZeRO-{stage:g}" if isinstance(stage, (int, float)) and not pd.isna(stage) else "ZeRO-?"]
        parts += [keys[k](row[k]) for k in varying if not pd.isna(row[k])]
        names[i] = " ".join(p for p in parts if p)
    compared = [names[i] for i in (g.index if unique_among is None else unique_among)]
    if len(set(compared)) < len(compared):
        return {i: str(g.at[i, "config"]) for i in g.index}
    return names


# -- the three rules -------------------------------------------------------------------------------

def largest_batch(ok: pd.DataFrame, names: dict) -> Pick:
    order = ok.sort_values([BSZ, SPS], ascending=False).index
    win = order[0]
    base = baseline_index(ok)
    ref = base if base != win else order[1]
    w, r = ok.loc[win], ok.loc[ref]
    others = [i for i in order[1:] if i != ref][:MOST_COMPARED]
    tail = "".join(f"; {names[i]} fits {ok.at[i, BSZ]:,.0f}" for i in others)
    text = (f"Largest batch: {names[win]} fits {w[BSZ]:,.0f} samples, {w[BSZ] / r[BSZ]:.2f}x {names[ref]}, "
            f"and {_faster(w[SPS], r[SPS])}{tail}.")
    return Pick("largest batch", str(w["config"]), text)


def fastest(ok: pd.DataFrame, names: dict, train_tokens: Optional[float] = None) -> Pick:
    order = ok.sort_values([SPS, BSZ], ascending=False).index
    w = ok.loc[order[0]]
    text = (f"Fastest: {names[order[0]]} runs {fmt(w[SPS])} samples/s at its max batch of {w[BSZ]:,.0f}, "
            + _versus(ok, order, names, SPS, "more") )
    if train_tokens and DAYS_TO_TRAIN in ok.columns and not pd.isna(w[DAYS_TO_TRAIN]):
        text += f"; it trains {tokens_text(train_tokens)} tokens in {fmt(w[DAYS_TO_TRAIN])} days"
    return Pick("fastest", str(w["config"]), text + ".")


def cheapest(ok: pd.DataFrame, names: dict, train_tokens: Optional[float] = None) -> Pick:
    priced = ok[ok[COST_PER_MTOK].notna()]
    order = priced.assign(_neg=-priced[SPS]).sort_values([COST_PER_MTOK, "_neg"]).index
    w = priced.loc[order[0]]
    devices = int(w["# gpus"])
    text = (f"Cheapest: {names[order[0]]} at {fmt(w[COST_PER_MTOK])} per 1M tokens ({fmt(w[COST_PER_HOUR])} per "
            f"hour for {devices} device{'s' if devices != 1 else ''}), " + _versus(priced, order, names, COST_PER_MTOK,
                                                                                  "less"))
    if train_tokens and COST_TO_TRAIN in priced.columns and not pd.isna(w[COST_TO_TRAIN]):
        text += (f"; training {tokens_text(train_tokens)} tokens costs {fmt(w[COST_TO_TRAIN])} and takes "
                 f"{fmt(w[DAYS_TO_TRAIN])} days")
    return Pick("cheapest", str(w["config"]), text + ".")


def predicted_picks(g: pd.DataFrame, train_tokens: Optional[float] = None) -> tuple[Pick, ...]:
    """The time estimate's fastest and (with a price) cheapest among the group's configurations with a
    max batch and a prediction (none where fewer than two have one)."""
    if PRED_SPS not in g.columns:
        return ()
    fit = g[g[BSZ].notna() & pd.to_numeric(g[PRED_SPS], errors="coerce").notna()]
    if len(fit) < 2:
        return ()
    names = config_names(g, unique_among=fit.index)
    order = fit.sort_values([PRED_SPS, BSZ], ascending=False).index
    w = fit.loc[order[0]]
    term = f", its predicted time dominated by {w[PRED_TERM]}" if PRED_TERM in fit.columns and not pd.isna(
        w[PRED_TERM]) else ""
    text = (f"Fastest (predicted): {names[order[0]]} would run {fmt(w[PRED_SPS])} samples/s (predicted, "
            f"{fmt(w[PRED_TIME])} ms/it{term}) at its max batch of {w[BSZ]:,.0f}, "
            + _versus(fit, order, names, PRED_SPS, "more"))
    if train_tokens and PRED_DAYS_TO_TRAIN in fit.columns and not pd.isna(w[PRED_DAYS_TO_TRAIN]):
        text += f"; it would train {tokens_text(train_tokens)} tokens in {fmt(w[PRED_DAYS_TO_TRAIN])} days (predicted)"
    picks = (Pick("fastest (predicted)", str(w["config"]), text + "."),)
    if PRED_COST_PER_MTOK in fit.columns and fit[PRED_COST_PER_MTOK].notna().any():
        priced = fit[fit[PRED_COST_PER_MTOK].notna()]
        order = priced.assign(_neg=-priced[PRED_SPS]).sort_values([PRED_COST_PER_MTOK, "_neg"]).index
        c = priced.loc[order[0]]
        text = (f"Cheapest (predicted): {names[order[0]]} at {fmt(c[PRED_COST_PER_MTOK])} per 1M tokens (predicted), "
                + _versus(priced, order, names, PRED_COST_PER_MTOK, "less") if len(order) > 1 else
                f"Cheapest (predicted): {names[order[0]]} at {fmt(c[PRED_COST_PER_MTOK])} per 1M tokens (predicted)")
        picks += (Pick("cheapest (predicted)", str(c["config"]), text + "."),)
    return picks


RUNGS = ("none", "cpu", "nvme")  # ZeRO's offload ladder, from host memory only to the disk


def ladder(ok: pd.DataFrame, names: dict) -> Optional[Pick]:
    """Where the group holds more than one offload rung (the report's "offload" column: "none",
    "cpu: ...", "nvme: ..."): climbing from no offload, which rung first fits a larger batch than
    every rung below it, and what it costs in samples/s against the rung without offload (or the
    lowest measured). None with one rung."""
    if "offload" not in ok.columns:
        return None
    rung = ok["offload"].astype(str).str.split(":").str[0]
    if rung.nunique() < 2:
        return None
    parts, best, base = [], 0.0, None
    for r in RUNGS:
        rows = ok[rung == r]
        if rows.empty:
            continue
        i = rows.sort_values([BSZ, SPS], ascending=False).index[0]
        bsz, sps = ok.at[i, BSZ], ok.at[i, SPS]
        if base is None:
            parts.append(f"{names[i]} fits up to {bsz:,.0f} samples ({fmt(sps)} samples/s)")
            base, best = sps, bsz
        elif bsz > best:
            parts.append(f"{names[i]} is the first rung that fits {bsz:,.0f} and {_faster(sps, base)}")
            best = bsz
        else:
            parts.append(f"{names[i]} fits no more ({bsz:,.0f})")
    return Pick("ladder", "", "Offload ladder: " + "; ".join(parts) + ".")


def longest_seq(ok: pd.DataFrame, names: dict) -> Pick:
    """ "At 8 GPUs, ZeRO-3 at sp 8 with tiled MLP and checkpoint offload trains 65,536 tokens per
    sequence (micro 1), 2.00x ZeRO-3 sp1 (32,768)." """
    speed = ok[TPS] if TPS in ok.columns else pd.Series(0.0, index=ok.index)
    order = ok.assign(_tps=speed.fillna(0.0)).sort_values([SEQ, "_tps"], ascending=False).index
    w = ok.loc[order[0]]
    base = config_names(ok, unique_among=[order[0]], keys={k: f for k, f in NAMED.items() if k not in LONG})
    winner = " ".join(x for x in (base[order[0]], long_context(w)) if x)
    unit = UNITS.get(str(w.get("device", "")), "devices")
    n, micro = w.get("# gpus"), w.get("micro batch")
    where = f"At {int(n)} {unit}, " if n is not None and not pd.isna(n) else ""
    at = f" (micro {int(micro)})" if micro is not None and not pd.isna(micro) else ""
    rate = f" at {fmt(w[TPS])} tokens/s" if TPS in ok.columns and not pd.isna(w[TPS]) else ""
    text = f"{where}{winner} trains {w[SEQ]:,.0f} tokens per sequence{at}{rate}"
    others = [f"{w[SEQ] / ok.at[i, SEQ]:.2f}x {names[i]} ({ok.at[i, SEQ]:,.0f})"
              for i in order[1:1 + MOST_COMPARED]]
    return Pick("longest sequence", str(w["config"]), text + (", " + ", ".join(others) if others else "") + ".")


def long_context(row: pd.Series) -> str:
    """ "at sp 8 with tiled MLP and checkpoint offload": the row's long-sequence settings among those
    the frame has a column for (a report where no row uses a setting does not name it); the savers
    it runs, or "without" those it could have."""
    sp = row.get("sequence parallel")
    on, off = [], []
    for col in ("tiled MLP", "checkpoint offload"):
        v = row.get(col)
        if v is not None and not pd.isna(v):
            (off if v == "No" else on).append(_tiled(v) if col == "tiled MLP" else col)
    savers = f"with {' and '.join(on)}" if on else (f"without {' or '.join(off)}" if off else "")
    return " ".join(x for x in (f"at sp {sp:g}" if sp is not None and not pd.isna(sp) else "", savers) if x)


def _tiled(v) -> str:
    return "tiled MLP" if str(v) in ("auto", "No") else f"tiled MLP ({v} tiles)"


def _only(row: pd.Series, name: str) -> Pick:
    cost = f", {fmt(row[COST_PER_MTOK])} per 1M tokens" if not pd.isna(row.get(COST_PER_MTOK)) else ""
    text = f"Only {name} was measured: it fits {row[BSZ]:,.0f} samples and runs {fmt(row[SPS])} samples/s{cost}."
    return Pick("only", str(row["config"]), text)


# -- wording -----------------------------------------------------------------------------------------

def _faster(v: float, ref: float) -> str:
    pct = (v / ref - 1) * 100
    if round(abs(pct)) == 0:
        return "runs as fast"
    return f"runs {abs(pct):.0f} % {'faster' if pct > 0 else 'slower'}"


def _versus(df: pd.DataFrame, order, names: dict, col: str, word: str) -> str:
    """ "14 % more than ZeRO-0 (15.7) and 41 % more than ZeRO-3 (12.6)": the winner against the others."""
    win = df.at[order[0], col]
    parts = []
    for i in order[1:1 + MOST_COMPARED]:
        v = df.at[i, col]
        pct = abs(win / v - 1) * 100 if v else float("nan")
        parts.append(f"{pct:.0f} % {word} than {names[i]} ({fmt(v)})")
    more = len(order) - 1 - MOST_COMPARED
    if more > 0:
        parts.append(f"{more} other{'s' if more > 1 else ''}")
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


def fmt(x: float) -> str:
    """Three significant digits, thousands separated: 1,218 / 17.8 / 1.22 / 0.0351."""
    a = abs(x)
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def advice_lines(advice: list[Advice]) -> list[tuple[str, str]]:
    """(style, text) lines for the Summary sheet and the .md: "group" headings and "pick" sentences."""
    lines = []
    for a in advice:
        lines.append(("group", a.heading))
        lines += [("pick", p.sentence) for p in a.picks]
        if a.unmeasured:
            lines.append(("pick", a.unmeasured))
    return lines
