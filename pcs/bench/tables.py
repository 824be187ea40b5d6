"""A bench results file read back: its markdown tables (costs, pools, selection overheads) and the engine's
targets (``targets.yaml``) read off it. Torch-free."""
from __future__ import annotations

import dataclasses
import statistics
from functools import cache
from pathlib import Path

from omegaconf import OmegaConf


@cache
def goals():
    """The engine's targets (``pcs/bench/targets.yaml``): goals a results file is read against, kept apart from
    the code that reads it."""
    return OmegaConf.to_container(OmegaConf.load(Path(__file__).with_name("targets.yaml")))


def selection_label(row: dict) -> str:
    return row["selection"] + (f" ({row['preset']})" if row.get("preset") else "")


def format_row(row: dict) -> str:
    return (f"{row['context']:>7} {row['method']:<12} {selection_label(row):<13} {str(row['budget'] or '-'):>6} "
            f"prefill {row['prefill_s']:8.3f} s  decode {row['decode_ms_per_token']:8.2f} ms/tok  "
            f"KV {row['kv_bytes'] / 2**20:8.1f}/{row['kv_bytes_full'] / 2**20:8.1f} MiB  "
            f"peak +{row['peak_mem_bytes'] / 2**20:7.1f} MiB  speed-up {row['decode_speedup']:5.2f} "
            f"(bound {row['decode_bound']:5.2f})  {row['attention_calls_per_token']:g} attention calls/token"
            + (f"  compressing {100 * row['compress_share']:4.1f} %" if "compress_share" in row else "")
            + (f"  stage 2 exact {100 * row['stage2_exact_share']:.1f} % of entries, "
               f"{100 * row['stage2_widened_share']:.0f} % of heads widened" if "stage2_exact_share" in row else "")
            + "".join(f"  pool {size}: {p['tokens_per_s']:.1f} tok/s ({p['ms_per_step']:.1f} ms/step)"
                      if "tokens_per_s" in p else f"  pool {size}: only {p['fits']} fit"
                      for size, p in row.get("pools", {}).items()))


def pool_table(rows: list[dict]) -> str:
    """Decoding throughput by pool size: tokens per second (ms per step), and each pool's speed-up over one."""
    rows = [r for r in rows if r.get("pools")]
    if not rows:
        return ""
    sizes = sorted({int(size) for r in rows for size in r["pools"]})
    head = "| context | method | selection | budget | " + " | ".join(f"pool {n}: tok/s (ms/step)" for n in sizes) \
        + " | " + " | ".join(f"pool {n} / pool {sizes[0]}" for n in sizes[1:]) + " |"
    lines = [head, "|---:|---|---|---:|" + "---:|" * (2 * len(sizes) - 1)]
    for r in rows:
        pools = {int(k): v for k, v in r["pools"].items()}
        measured = {n: p for n, p in pools.items() if "tokens_per_s" in p}
        cells = [f"{measured[n]['tokens_per_s']:.1f} ({measured[n]['ms_per_step']:.1f})" if n in measured
                 else f"{pools[n]['fits']} fit" if n in pools else "-" for n in sizes]
        ratios = [f"{measured[n]['tokens_per_s'] / measured[sizes[0]]['tokens_per_s']:.2f}"
                  if n in measured and sizes[0] in measured else "-" for n in sizes[1:]]
        lines.append(f"| {r['context']} | {r['method']} | {r['selection']} | {r['budget'] or '-'} | "
                     + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """A results file as the table of results/bench/README.md (peak: the allocator's total on CUDA, the
    growth of resident memory on CPU; compressing: ``--profile``'s share, where measured)."""
    profiled = any("compress_share" in r for r in rows)
    worked = any("stage2_exact_share" in r for r in rows)
    lines = ["| context | method | selection | budget | prefill+compress s | decode ms/token | KV MiB kept / full "
             "| peak GiB | decode speed-up | bound | attention calls/token |" + (" compressing |" if profiled else "")
             + (" stage-2 exact norms / entries | heads widened |" if worked else ""),
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if profiled else "")
             + ("---:|---:|" if worked else "")]
    for r in rows:
        peak = r.get("peak_mem_total_bytes") or r["peak_mem_bytes"]
        work = (f" {100 * r['stage2_exact_share']:.1f} % | {100 * r['stage2_widened_share']:.0f} % |"
                if "stage2_exact_share" in r else " - | - |")
        lines.append(f"| {r['context']} | {r['method']} | {selection_label(r)} | {r['budget'] or '-'} | {r['prefill_s']:.3f} "
                     f"| {r['decode_ms_per_token']:.2f} | {r['kv_bytes'] / 2**20:.1f} / {r['kv_bytes_full'] / 2**20:.1f} "
                     f"| {peak / 2**30:.2f} | {r['decode_speedup']:.2f} | {r['decode_bound']:.2f} "
                     f"| {r.get('attention_calls_per_token', float('nan')):g} |"
                     + (f" {100 * r['compress_share']:.1f} % |" if profiled else "") + (work if worked else ""))
    return "\n".join(lines)


def compression_label(row: dict) -> str:
    """How a row's prefill compressed: when, with which exact norms (``--value-norm-kernel``) and whether stage 2
    scored every entry (``--stage2-search``; under auto, in which share of the entries)."""
    layers = row.get("compression_layers_behind", 0)
    when = "after each layer" if not layers else f"{layers} layer{'s' if layers > 1 else ''} behind"
    search = {"exhaustive": ", every entry scored", "auto": ", bounded (auto)"}.get(row.get("stage2_search"), "")
    every = row.get("stage2_every_entry_share", 0.0)
    if row.get("stage2_search") == "auto" and every:
        search = f", bounded, then every entry in {100 * every:.1f} % of the entries (loose bounds)"
    return when + (", norms kernel" if row.get("value_norm_kernel") else "") + search


def selection_table(rows: list[dict]) -> str:
    """Perturbation over attention selection per (context, method, budget, conventions): the compressions' seconds,
    the ratio of prefill plus compression (``selection_overheads``) and of the whole prefills, and stage 2's work."""
    pairs = selection_overheads(rows)
    if not pairs:
        return ""
    lines = ["| context | method | budget | conventions | compression | compression s: attention, perturbation | "
             "perturbation / attention | by round, lowest-highest | whole prefills | exact norms / entries | "
             "d^2 bounds / entries | kept on the lower bound / entries | heads with a second round | "
             "ops per layer: attention, perturbation | median over fastest round: attention, perturbation |",
             "|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for o in pairs:
        r = o.row
        times = f"{o.base['compress_s']:.3f}, {r['compress_s']:.3f}" if "compress_s" in r else "-"
        share = lambda key: f"{100 * r[key]:.1f} %" if key in r else "-"
        rounds = o.round_ratios
        by_round = f"{min(rounds):.3f}-{max(rounds):.3f} ({len(rounds)})" if rounds else "-"
        ops = f"{o.base['compress_ops_per_layer']:.0f}, {r['compress_ops_per_layer']:.0f}" \
            if "compress_ops_per_layer" in r and "compress_ops_per_layer" in o.base else "-"
        lines.append(f"| {r['context']} | {r['method']} | {r['budget']} | "
                     f"{'preset=' + r['preset'] if r.get('preset') else 'paper'} | "
                     f"{compression_label(r)} | "
                     f"{times} | {o.ratio:.3f} | {by_round} | "
                     f"{o.wall_ratio:.3f} | {share('stage2_exact_share')} | {share('stage2_gram_share')} | "
                     f"{share('stage2_certified_share')} | {share('stage2_widened_share')} | {ops} | "
                     f"{spread(o.base)}, {spread(r)}{' (void)' if o.void else ''} |")
    return "\n".join(lines)


def rounds_spread(row: dict) -> float | None:
    """How far a row's median prefill lies above its fastest round (0.1: 10 %), where the row kept its rounds: with
    3 rounds or more one outlier leaves the median where the others are, with 2 it moves it halfway."""
    rounds = row.get("prefill_rounds_s")
    return statistics.median(rounds) / min(rounds) - 1 if rounds and len(rounds) > 1 else None


def spread(row: dict) -> str:
    value = rounds_spread(row)
    return "-" if value is None else f"{100 * value:.0f} %"


# A pair is void where a row's median lies more than this above its fastest round: an outlier round (another
# process, a clock change) moved the median by more than the overheads measured.
VOID_SPREAD = 0.10

@dataclasses.dataclass(frozen=True)
class Overhead:
    """A perturbation row against the attention row with the same context, method, budget and preset."""
    row: dict
    base: dict

    @property
    def outliers(self) -> list[str]:
        """The pair's rows (attention, perturbation) whose median lies more than ``VOID_SPREAD`` above their fastest
        round, where the ratio is the whole prefills' (the compressions' difference is measured apart from the
        forward's rounds)."""
        if not self.whole_prefills:
            return []
        return [name for name, r in (("attention", self.base), ("perturbation", self.row))
                if (rounds_spread(r) or 0) > VOID_SPREAD]

    @property
    def void(self) -> bool:
        """Whether an outlier round moved a row's median: the ratio says nothing."""
        return bool(self.outliers)

    @property
    def whole_prefills(self) -> bool:
        """Whether ``ratio`` is the whole prefills' ratio."""
        return "compress_s" not in self.row or "compress_s" not in self.base \
            or bool(self.row.get("compression_layers_behind"))

    @property
    def wall_ratio(self) -> float:
        """The whole prefills' ratio."""
        return self.row["prefill_s"] / self.base["prefill_s"]

    @property
    def ratio(self) -> float:
        """Prefill plus compression over the attention row's. Where both rows timed their compression
        (``compress_s``) it is ``(P_a - C_a + C_p) / P_a``: the forward is the same work under both selections, so
        the difference of the compressions' medians measures the overhead without the forward's noise, which on a
        busy CPU is larger than the overhead itself. Where the compression ran behind the forward, beside it (CUDA's
        ``compression_layers_behind``), its seconds are not added to the prefill's: the whole prefills' ratio."""
        if self.whole_prefills:
            return self.wall_ratio
        return (self.base["prefill_s"] - self.base["compress_s"] + self.row["compress_s"]) / self.base["prefill_s"]

    @property
    def round_ratios(self) -> list[float]:
        """``ratio`` per round, each row's i-th round against the other's i-th: the bench measures every
        configuration once a round, in turn, so a round's rows ran within one pass over the configurations, closer
        in time than rounds apart. Empty where a row kept no rounds (older files) or the rows kept unequal numbers."""
        a, p = self.base, self.row
        keys = ("prefill_rounds_s",) if self.whole_prefills else ("prefill_rounds_s", "compress_rounds_s")
        if not all(k in r for k in keys for r in (a, p)) or len({len(r[k]) for k in keys for r in (a, p)}) != 1:
            return []
        if self.whole_prefills:
            return [x / y for x, y in zip(p["prefill_rounds_s"], a["prefill_rounds_s"])]
        return [(pa - ca + cp) / pa for pa, ca, cp in zip(a["prefill_rounds_s"], a["compress_rounds_s"],
                                                          p["compress_rounds_s"])]

    def verdict(self, limit: float) -> str:
        """Against a target ratio ``limit``: met or missed in every round (``round_ratios``), else undecided (some
        rounds on either side: the target lies within the rounds' spread); by the medians' ratio alone where the
        rows kept no rounds."""
        rounds = self.round_ratios or [self.ratio]
        return "met" if max(rounds) <= limit else "missed" if min(rounds) > limit else "undecided"


def selection_overheads(rows: list[dict]) -> list[Overhead]:
    """Each perturbation row paired with the attention row under the same conventions."""
    def key(r):
        return (r["context"], r["method"], r["budget"], r.get("preset"), r.get("compression_layers_behind", 0),
                r.get("value_norm_kernel", False), r.get("value_norm_blocks"), r.get("stage2_search", "bounded"))
    attention = {key(r): r for r in rows if r["selection"] == "attention"}
    return [Overhead(r, attention[key(r)]) for r in rows if r["selection"] == "perturbation" and key(r) in attention]


# The decode targets read only rows that decoded at least this many tokens: a row decoding 2 (a prefill-only
# measurement) times one step after the prefill's token, too short a sample of the cache's speed to judge it by.
LEAST_DECODED_TOKENS = 8


def targets(rows: list[dict]) -> list[str]:
    """The engine's targets (``goals``), read off a results file: perturbation selection's prefill + compression
    over attention selection's by context and device (met or missed in every round of every pair, else undecided:
    ``Overhead.verdict``); decoding on a small cache against the memory-traffic bound; every compressed cache at
    least as fast as the full cache from a context up; pools' tokens per second over one sequence's; attention calls
    per layer and decoded token."""
    goal = goals()
    out = []
    overheads = selection_overheads(rows)
    for context in sorted({o.row["context"] for o in overheads}):
        void = [o for o in overheads if o.row["context"] == context and o.void]
        here = [o for o in overheads if o.row["context"] == context and not o.void]
        voided = (f"; {len(void)} void, a row's median more than {100 * VOID_SPREAD:.0f} % above its fastest round: "
                  + ", ".join(f"{o.row['method']} {selection_label(o.row)} b{o.row['budget']} (its "
                              f"{' and '.join(o.outliers)} row)" for o in void)) \
            if void else ""
        if not here:
            out.append(f"perturbation over attention selection, prefill + compression at {context}: no pair"
                       f"{voided}")
            continue
        worst = max(here, key=lambda o: o.ratio)
        r = worst.row
        limit = goal["selection_overhead"]["cpu" if r["device"] == "cpu" else "cuda"].get(context)
        walls = [o.wall_ratio for o in here]
        verdict = ""
        if limit:      # the context's verdict is its worst pair's: missed over undecided over met
            verdicts = [o.verdict(limit) for o in here]
            overall = next(v for v in ("missed", "undecided", "met") if v in verdicts)
            open_ = [f"{o.row['method']} {selection_label(o.row)} b{o.row['budget']} {v} "
                     f"({min(o.round_ratios):.3f}x-{max(o.round_ratios):.3f}x)" if o.round_ratios else
                     f"{o.row['method']} {selection_label(o.row)} b{o.row['budget']} {v}"
                     for o, v in zip(here, verdicts) if v != "met"]
            verdict = f" [target <= {limit:.2f}x: {overall}]" + (f" (by round: {'; '.join(open_)})" if open_ else "")
        out.append(f"perturbation over attention selection, prefill + compression at {context}: "
                   f"{min(o.ratio for o in here):.3f}x to {worst.ratio:.3f}x over {len(here)} pairs (most: {r['method']} "
                   f"{selection_label(r)} b{r['budget']}; whole prefills' ratios {min(walls):.3f}x to {max(walls):.3f}x"
                   f"{voided})" + verdict)
    decoded = [r for r in rows if r.get("decode_tokens", LEAST_DECODED_TOKENS) >= LEAST_DECODED_TOKENS]
    if len(decoded) < len(rows):
        out.append(f"decode targets: {len(rows) - len(decoded)} rows not read, which decoded fewer than "
                   f"{LEAST_DECODED_TOKENS} tokens")
    bound = goal["decode_bound"]
    for r in decoded:
        if r["budget"] == bound["budget"] and r["context"] in bound["contexts"]:
            share = r["decode_speedup"] / r["decode_bound"]
            out.append(f"decode at {r['context']}, {r['method']}/{r['selection']} b{r['budget']}: {100 * share:.0f} % "
                       f"of the bound {r['decode_bound']:.2f} [target >= {100 * bound['share']:.0f} %: "
                       f"{'met' if share >= bound['share'] else 'missed'}]")
    start = goal["compressed_not_slower_from"]
    slower = [r for r in decoded if r["budget"] is not None and r["context"] >= start and r["decode_speedup"] <= 1]
    if decoded:
        out.append(f"compressed caches decoding no faster than the full cache from {start // 1024}K up: {len(slower)}"
                   + "".join(f"; {r['context']} {r['method']}/{r['selection']} b{r['budget']} "
                             f"{r['decode_speedup']:.2f}x" for r in slower)
                   + f" [target 0: {'met' if not slower else 'missed'}]")
    for size, need, context in ((g["size"], g["least"], g.get("context")) for g in goal["pool_gain"]):
        gains = [(pools[size] / pools[1], r) for r in rows
                 for pools in [{int(k): v["tokens_per_s"] for k, v in r.get("pools", {}).items() if "tokens_per_s" in v}]
                 if 1 in pools and size in pools and (context is None or r["context"] == context)]
        if gains:
            worst, r = min(gains, key=lambda g: g[0])
            out.append(f"pool of {size}{f' at {context}' if context else ''}: {worst:.2f}x to "
                       f"{max(g for g, _ in gains):.2f}x the tokens per second of one sequence over {len(gains)} rows "
                       f"(least: {r['context']} {r['method']}/{r['selection']} b{r['budget']}) [target >= {need:g}x: "
                       f"{'met' if worst >= need else 'missed'}]")
    most = max((r.get("attention_calls_per_token", 0) / r["layers"] for r in rows if r.get("layers")), default=None)
    calls = goal["attention_calls_per_layer"]
    if most is not None:
        out.append(f"attention calls per layer and decoded token: at most {most:g} [target <= {calls}: "
                   f"{'met' if most <= calls else 'missed'}]")
    return out


def decode_rows(rows: list[dict]) -> list[dict]:
    """The rows of ``python -m pcs.bench --decode`` in a results file."""
    return [r for r in rows if "bound_ms" in r]


def decode_table(rows: list[dict]) -> str:
    """The decode bench's table: per context, configuration, pool size and graphs, the step against its bound."""
    lines = ["| context | cache | pool | attention | forward | CUDA graphs | ms/step | tokens/s | bound ms | x bound "
             "| per layer |",
             "|---:|---|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        cache = r["method"] + (f" b{r['budget']}" if r.get("budget") else "")
        how = ("kernel" if r.get("decode_kernel") else "masked") + \
            f" | {'compiled' if r.get('compiled') else 'eager'}"
        if "ms_per_step" not in r:
            lines.append(f"| {r['context']} | {cache} | {r['pool']} | {how} | {'yes' if r['cuda_graphs'] else 'no'} | "
                         f"fits {r['fits']} | - | {r['bound_ms']:.2f} | - | - |")
            continue
        ops = f"{r['kernels_per_layer']:.0f} kernels" if "kernels_per_layer" in r else \
            f"{r['ops_per_layer']:.0f} ops" if "ops_per_layer" in r else "-"
        lines.append(f"| {r['context']} | {cache} | {r['pool']} | {how} | {'yes' if r['cuda_graphs'] else 'no'} | "
                     f"{r['ms_per_step']:.2f} | {r['tokens_per_s']:.1f} | {r['bound_ms']:.2f} | {r['of_bound']:.2f} | "
                     f"{ops} |")
    bandwidth = {r["bandwidth_gb_s"] for r in rows}
    return "\n".join(lines) + "\n\nCopy bandwidth measured in the same process: " + \
        ", ".join(f"{b:.0f} GB/s" for b in sorted(bandwidth))


def decode_targets(rows: list[dict]) -> list[str]:
    """The decode targets (``goals()["decode"]``) read off ``--decode`` rows as the engine runs by default where the
    file has them (``as_the_engine_runs``); a target whose rows are absent is said to be unmeasured."""
    from ..projection import as_the_engine_runs
    goal = goals()["decode"]
    timed = as_the_engine_runs([r for r in rows if "ms_per_step" in r])

    def pick(**where):
        return [r for r in timed if all(r.get(k) == v for k, v in where.items())]

    def verdict(ok: bool) -> str:
        return "met" if ok else "missed"

    out = []
    g = goal["full_batch1"]
    found = pick(method="full", pool=1, context=g["context"])
    out.append(f"full cache, batch 1, at {g['context']}: " + (
        f"x{found[0]['of_bound']:.2f} of its bound [target <= {g['of_bound']}: "
        f"{verdict(found[0]['of_bound'] <= g['of_bound'])}]" if found else "not measured"))
    g = goal["small_budget"]
    found = [r for r in pick(pool=1, budget=g["budget"]) if r["context"] in g["contexts"] and r["method"] != "mixed"]
    out.append(f"budget {g['budget']}, batch 1, at {' and '.join(map(str, g['contexts']))}: " + (
        f"x{min(r['of_bound'] for r in found):.2f} to x{max(r['of_bound'] for r in found):.2f} of their bounds "
        f"[target <= {g['of_bound']}: {verdict(max(r['of_bound'] for r in found) <= g['of_bound'])}]"
        if found else "not measured"))
    start = goal["compressed_not_slower_from"]
    full = {(r["context"], r["pool"]): r["ms_per_step"] for r in pick(method="full")}
    slower = [r for r in timed if r["budget"] and r["context"] >= start and (r["context"], r["pool"]) in full
              and r["ms_per_step"] > full[(r["context"], r["pool"])]]
    compared = [r for r in timed if r["budget"] and r["context"] >= start and (r["context"], r["pool"]) in full]
    out.append(f"compressed steps slower than the full cache's from {start}: " + (
        f"{len(slower)} of {len(compared)}" + "".join(f"; {r['context']} {r['method']} b{r['budget']} pool {r['pool']}"
                                                        for r in slower)
        + f" [target 0: {verdict(not slower)}]" if compared else "not measured"))
    g = goal["pool_gain"]
    one = pick(pool=1, context=g["context"], budget=g["budget"])
    many = pick(pool=g["size"], context=g["context"], budget=g["budget"])
    pairs = [(m, o) for m in many for o in one if m["method"] == o["method"]]
    out.append(f"pool of {g['size']} at {g['context']}, budget {g['budget']}: " + (
        "; ".join(f"{m['method']} {m['tokens_per_s'] / o['tokens_per_s']:.1f}x batch 1's tokens/s, x{m['of_bound']:.2f} "
                  f"of its bound" for m, o in pairs)
        + f" [target >= {g['least']:g}x and <= x{g['of_bound']}: "
        f"{verdict(all(m['tokens_per_s'] / o['tokens_per_s'] >= g['least'] and m['of_bound'] <= g['of_bound'] for m, o in pairs))}]"
        if pairs else "not measured"))
    g = goal["mixed"]
    found = pick(method="mixed")
    out.append("mixed pools: " + (
        f"x{min(r['of_bound'] for r in found):.2f} to x{max(r['of_bound'] for r in found):.2f} of their rows' bounds "
        f"[target <= {g['of_bound']}: {verdict(max(r['of_bound'] for r in found) <= g['of_bound'])}]"
        if found else "not measured"))
    return out
