"""The benchmark runs end to end on a tiny model and writes well-formed rows (timings not asserted)."""
import json
import statistics

import pytest

from pcs.bench.__main__ import main
from pcs.bench.instrument import compression_breakdown

FIELDS = {"model", "method", "selection", "budget", "context", "prefill_s", "decode_ms_per_token", "kv_bytes",
          "kv_bytes_full", "peak_mem_bytes", "decode_bound", "decode_speedup"}


def test_bench_rows_are_well_formed(tiny_model_dir, capsys, tmp_path):
    main(["--profile", str(tmp_path), "--model-path", str(tiny_model_dir), "--contexts", "300", "--methods", "snapkv", "adakv",
          "knorm", "--selections", "attention", "perturbation", "--budgets", "64", "--repeats", "1",
          "--decode-tokens", "4", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["method"], r["selection"]) for r in rows] == [
        ("full", "none"), ("snapkv", "attention"), ("snapkv", "perturbation"), ("adakv", "attention"),
        ("adakv", "perturbation"), ("knorm", "attention"), ("knorm", "perturbation")]
    # On a CPU stage 2 is bounded, but over KNorm's negative scores it scores every entry, and its row says so.
    assert [r["stage2_search"] for r in rows if r["selection"] == "perturbation"] == ["bounded", "bounded", "exhaustive"]
    for r in rows:
        assert FIELDS <= set(r) and r["context"] == 300 and r["prefill_s"] > 0 and r["decode_ms_per_token"] > 0
        assert r["kv_bytes_full"] == rows[0]["kv_bytes_full"]
        assert r["decode_bound"] >= 1 and (r["kv_bytes"] < r["kv_bytes_full"]) == (r["method"] != "full")
    assert all(0 <= r["compress_share"] < 1 for r in rows)
    # Operations per layer's compression: none for the full cache, more for stage 2 than for attention selection.
    ops = {(r["method"], r["selection"]): r["compress_ops_per_layer"] for r in rows}
    assert ops["full", "none"] == 0 and 0 < ops["snapkv", "attention"] < ops["snapkv", "perturbation"]
    assert len(list(tmp_path.glob("300_*.txt"))) == len(rows)
    # Each profile ends with the ops inside the compression spans, per layer (one span per layer of the tiny model).
    breakdown = (tmp_path / "300_snapkv_perturbation_64.txt").read_text().split("Inside pcs.compress")[1]
    assert f"({rows[0]['layers']} spans)" in breakdown and "aten::topk" in breakdown
    assert rows[0]["decode_speedup"] == 1.0 and rows[0]["decode_bound"] == 1.0


def test_the_compression_breakdown_counts_the_hosts_spans_only():
    """With CUDA activity the profiler lists each ``pcs.compress`` span twice, on the host (with its operators)
    and as a device-side annotation (with none): per layer means per host span."""
    from types import SimpleNamespace as Event
    from torch.autograd import DeviceType
    kernel = Event(name="aten::bmm", cpu_children=[], kernels=[object()], self_device_time_total=300.0,
                   self_cpu_time_total=20.0)
    events = []
    for _ in range(3):                                                   # three layers
        events.append(Event(name="pcs.compress", device_type=DeviceType.CPU, cpu_children=[kernel]))
        events.append(Event(name="pcs.compress", device_type=DeviceType.CUDA, cpu_children=[]))
    table = compression_breakdown(events)
    assert "(3 spans)" in table
    (line,) = [l for l in table.splitlines() if l.startswith("aten::bmm")]
    assert line.split()[1:] == ["1.0", "1.0", "0.300", "0.020"]


def test_bench_reports_attention_calls_and_its_table_reads_the_targets(tiny_model_dir, capsys, tmp_path):
    main(["--model-path", str(tiny_model_dir), "--contexts", "300", "--methods", "snapkv", "adakv", "--selections",
          "attention", "--budgets", "64", "--repeats", "1", "--decode-tokens", "3", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["attention_calls_per_token"] for r in rows] == [r["layers"] for r in rows]   # one call per layer
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["--report", str(path)])
    report = capsys.readouterr().out
    assert report.count("\n| 300 |") == 3
    assert "attention calls per layer and decoded token: at most 1 [target <= 2: met]" in report


def test_bench_times_the_perturbation_analysis(tiny_model_dir, capsys):
    main(["--perturbation-analysis", "--model-path", str(tiny_model_dir), "--contexts", "300", "--methods", "snapkv",
          "--budgets", "64", "--json"])
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert row["analysis"] == "perturbation" and row["prefill_s"] > 0 and row["measure_s"] > 0


def test_bench_decodes_pools_and_projects_a_sweep(tiny_model_dir, capsys, tmp_path):
    """Pools of 1 and 3 copies of the prompt decode the same number of steps (3 rows per step for the pool of 3),
    the report tabulates them, and ``--project`` prints a job per model of table 1 from the measured costs."""
    main(["--model-path", str(tiny_model_dir), "--contexts", "300", "600", "--methods", "snapkv", "--selections",
          "perturbation", "--budgets", "128", "--repeats", "1", "--decode-tokens", "5", "--pools", "1", "3", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    for r in rows:
        one, three = r["pools"]["1"], r["pools"]["3"]
        assert one["tokens_per_s"] == pytest.approx(1000 / one["ms_per_step"])
        assert three["tokens_per_s"] == pytest.approx(3000 / three["ms_per_step"])
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["--report", str(path)])
    assert "| pool 3 / pool 1 |" in capsys.readouterr().out
    main(["--project", "experiment=table1", "--bench", str(path), "--pools", "3"])
    out = capsys.readouterr().out
    assert "| 0 | llama31 | 9 | 3750 |" in out and "| 1 | mistral7b | 9 | 3750 |" in out
    assert "in pools of 3" in out


def test_a_presets_own_selection_keeps_the_presets_knobs():
    """The preset's perturbation row runs the preset's selection knobs (criticalkv: kvpress's CriticalKVPress), not
    the paper's defaults that ``selection=perturbation`` would put in their place."""
    from pcs.bench.__main__ import parse
    from pcs.bench.measure import build_configurations
    built = build_configurations(parse(["--methods", "snapkv", "--selections", "perturbation", "--budgets", "128",
                                        "--presets", "criticalkv"]))
    knobs = {(c.selection, c.preset): (m.selection.alpha, m.selection.stage2_source, m.selection.epsilon,
                                      m.selection.gqa) for c, m in built if c.selection == "perturbation"}
    assert knobs[("perturbation", None)] == (0.25, "unpooled", 0.0, "mean_of_products")
    assert knobs[("perturbation", "criticalkv")] == (0.5, "pooled", 1e-4, "product_of_means")


def test_bench_pairs_each_perturbation_row_with_attention_under_the_same_preset(tiny_model_dir, capsys, tmp_path):
    """``--presets criticalkv`` adds each method with attention selection and the preset's own under its conventions;
    perturbation rows report stage 2's work, and the report's overhead line divides each by its own baseline."""
    main(["--model-path", str(tiny_model_dir), "--contexts", "400", "--methods", "snapkv", "--selections",
          "attention", "perturbation", "--budgets", "128", "--presets", "criticalkv", "--repeats", "1",
          "--decode-tokens", "2", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["selection"], r["preset"]) for r in rows] == [
        ("none", None), ("attention", None), ("perturbation", None), ("attention", "criticalkv"),
        ("perturbation", "criticalkv")]
    for r in rows:
        two_stage = r["selection"] == "perturbation"
        assert ("stage2_exact_share" in r) == two_stage
        if two_stage:    # exact norms for some entries, never more than a candidate round and the exhaustive scan
            assert 0 < r["stage2_exact_share"] <= 2 and 0 <= r["stage2_widened_share"] <= 1
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["--report", str(path)])
    report = capsys.readouterr().out
    line = next(x for x in report.splitlines() if x.startswith("- perturbation over attention selection"))
    pairs = ((rows[2], rows[1]), (rows[4], rows[3]))
    # The compressions' difference over the attention row's prefill, and the whole prefills' ratio beside it.
    ratios = sorted((a["prefill_s"] - a["compress_s"] + r["compress_s"]) / a["prefill_s"] for r, a in pairs)
    walls = sorted(r["prefill_s"] / a["prefill_s"] for r, a in pairs)
    assert all(0 < r["compress_s"] < r["prefill_s"] for r in rows[1:])
    assert f"{ratios[0]:.3f}x to {ratios[1]:.3f}x over 2 pairs" in line
    assert f"whole prefills' ratios {walls[0]:.3f}x to {walls[1]:.3f}x" in line
    assert "| perturbation (criticalkv) |" in report
    assert "| 400 | snapkv | 128 | paper | after each layer |" in report
    assert "| 400 | snapkv | 128 | preset=criticalkv | after each layer |" in report
    # Rows whose compression ran behind the forward, beside it (CUDA), are compared by their whole prefills, and
    # only with rows compressed the same way.
    assert not any(r["compression_layers_behind"] for r in rows)
    beside = [dict(r, compression_layers_behind=2) for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + beside))
    main(["--report", str(path)])
    lines = [x for x in capsys.readouterr().out.splitlines() if "| 2 layers behind |" in x]
    # the ratio, its one round's (the bench ran 1), then the whole prefills': all the same when compressed behind
    assert len(lines) == 2 and all(
        f"| {x:.3f} | {x:.3f}-{x:.3f} (1) | {x:.3f} |" in line
        for line, x in zip(lines, (r["prefill_s"] / a["prefill_s"] for r, a in pairs)))


def test_gpu_readme_puts_a_devices_table_in_its_own_section_and_replaces_it(tmp_path):
    """scripts/gpu_readme.py on the committed H100 rows: the section goes after the README's text, named by the
    rows' device, holds the bench's report of those rows, and a second run replaces it instead of adding one."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).parents[1]
    rows = root / "results" / "bench" / "gpu_NVIDIA_H100_80GB_HBM3.jsonl"
    readme = tmp_path / "README.md"
    readme.write_text("# Bench\n\nText before.\n")
    script = [sys.executable, str(root / "scripts" / "gpu_readme.py"), str(rows), "--readme", str(readme)]
    report = subprocess.run(script, check=True, capture_output=True, text=True).stdout
    first = readme.read_text()
    assert first.startswith("# Bench\n\nText before.\n\n<!-- gpu NVIDIA_H100_80GB_HBM3 -->\n")
    assert report.strip() in first and "| 32768 | snapkv | perturbation |" in report
    readme.write_text(first.replace(report.strip(), "an older table") + "Text after.\n")
    subprocess.run(script, check=True, capture_output=True)
    assert readme.read_text() == first + "Text after.\n"


def test_a_bench_stopped_in_its_last_round_keeps_the_rows_measured_before(tiny_model_dir, capsys, monkeypatch):
    """A GPU lease ends a command at its time limit: every row whose last round was measured is printed already.
    Two rounds of 3 configurations; the bench is stopped at its fifth measurement (the last round's second), so
    the first configuration's row is out and no other."""
    import pcs.bench.measure as bench
    measure, calls = bench.measure_once, []

    def stopping(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise TimeoutError("the lease's time limit")
        return measure(*args, **kwargs)
    monkeypatch.setattr(bench, "measure_once", stopping)
    with pytest.raises(TimeoutError):
        main(["--model-path", str(tiny_model_dir), "--contexts", "300", "--methods", "snapkv", "--selections",
              "attention", "--budgets", "64", "32", "--repeats", "2", "--decode-tokens", "2", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["method"], r["budget"]) for r in rows] == [("full", None)] and rows[0]["repeats"] == 2


def test_compression_ops_counts_the_operations_inside_keep_that_dispatch_work():
    """``CompressionOps`` counts per ``keep`` call the operations that do work (two here: an add and a multiply),
    not views or allocations, and nothing outside ``keep``."""
    import torch
    from pcs.bench.instrument import CompressionOps
    from pcs.eviction.base import Method

    class TwoOps(Method):
        def keep(self, layer, stage2=None):
            doubled = (layer + 1).view(-1) * 2
            torch.empty(3)
            return doubled.t() if doubled.dim() == 2 else None

    method = TwoOps()
    with CompressionOps(method) as ops:
        for _ in range(3):
            ops.method.keep(torch.ones(4, 5))
            torch.ones(2) * 3                    # outside keep
    assert (ops.layers, ops.ops, ops.per_layer) == (3, 6, 2.0)
    assert "keep" not in vars(method)             # the method is as it was


def test_a_pair_whose_rounds_disagree_is_void_and_left_out_of_the_verdict():
    """A row whose median prefill lies more than VOID_SPREAD above its fastest round (an outlier among 2 rounds)
    voids its pair: the targets line names it and judges the other pairs alone. One outlier among 3 rounds leaves
    the median alone and voids nothing; rows without rounds (older files) are judged as before."""
    from pcs.bench.tables import VOID_SPREAD, selection_overheads, targets

    def row(method, selection, rounds):
        return {"context": 8192, "method": method, "selection": selection, "budget": 1024, "preset": None,
                "device": "cuda", "compression_layers_behind": 2, "prefill_s": statistics.median(rounds),
                "prefill_rounds_s": rounds, "decode_speedup": 1.5, "decode_bound": 2.0}
    rows = [row("snapkv", "attention", [0.250, 0.430]),              # an outlier among 2: the median 36 % above
            row("snapkv", "perturbation", [0.400, 0.401]),
            row("adakv", "attention", [0.250, 0.340, 0.251]),        # an outlier among 3: the median 0.4 % above
            row("adakv", "perturbation", [0.270, 0.268, 0.271])]
    pairs = selection_overheads(rows)
    assert [o.void for o in pairs] == [True, False]
    line = next(x for x in targets(rows) if x.startswith("perturbation over attention selection"))
    assert "over 1 pairs" in line and f"1 void, a row's median more than {100 * VOID_SPREAD:.0f} % above its " \
        "fastest round: snapkv perturbation b1024 (its attention row)" in line
    assert "[target <= 1.10x: met]" in line        # adakv's 0.270 / 0.251; snapkv's 1.178x is void
    for r in rows:
        del r["prefill_rounds_s"]
    line = next(x for x in targets(rows) if x.startswith("perturbation over attention selection"))
    assert "over 2 pairs" in line and "void" not in line and "[target <= 1.10x: missed]" in line
    # Where the ratio is the compressions' difference (compression after each layer, compress_s timed), the
    # forward's rounds do not void it.
    rounds = [row("snapkv", "attention", [0.250, 0.430]), row("snapkv", "perturbation", [0.300, 0.301])]
    for r in rounds:
        r.update(compression_layers_behind=0, compress_s=0.01)
    assert [o.void for o in selection_overheads(rounds)] == [False]


def test_decode_targets_read_only_rows_that_decoded_enough_tokens():
    """A row that decoded fewer than LEAST_DECODED_TOKENS tokens (prefill-only measurements decode 2) is left out of
    the decode targets, and the report says how many were; rows without the count (older files) are read."""
    from pcs.bench.tables import LEAST_DECODED_TOKENS, targets

    def row(speedup, **extra):
        return {"context": 32768, "method": "snapkv", "selection": "attention", "budget": 128, "preset": None,
                "device": "cuda", "prefill_s": 1.0, "decode_speedup": speedup, "decode_bound": 1.27, **extra}
    slow = [row(0.7, decode_tokens=2), row(1.3, decode_tokens=LEAST_DECODED_TOKENS)]
    lines = targets(slow)
    assert "decode targets: 1 rows not read, which decoded fewer than 8 tokens" in lines
    assert "compressed caches decoding no faster than the full cache from 8K up: 0 [target 0: met]" in lines
    assert sum(x.startswith("decode at 32768") for x in lines) == 1
    lines = targets([row(0.7)])
    assert not any(x.startswith("decode targets") for x in lines)
    assert any(x.startswith("compressed caches decoding no faster") and "missed" in x for x in lines)
    assert not any(x.startswith("compressed caches") for x in targets([row(0.7, decode_tokens=2)]))


def test_rows_under_auto_search_pair_with_their_attention_rows_and_say_where_every_entry_was_scored():
    """Under --stage2-search auto in long layers a perturbation row may bound some layers and score every entry of
    others (engine.stage2.loose_share): it pairs with the attention row of the same search, and the
    table says which share of its entries lay in layers scored in full."""
    from pcs.bench.tables import compression_label, selection_overheads

    def row(selection, every=None):
        r = {"context": 32768, "method": "snapkv", "budget": 128, "preset": "criticalkv", "device": "cuda",
             "selection": selection, "compression_layers_behind": 2, "value_norm_kernel": True,
             "stage2_search": "auto", "prefill_s": 1.0}
        return r | ({} if every is None else {"stage2_every_entry_share": every})
    attention, loose, tight = row("attention"), row("perturbation", 0.969), row("perturbation", 0.0)
    assert [o.row for o in selection_overheads([attention, loose, tight])] == [loose, tight]
    other = row("perturbation", 1.0) | {"stage2_search": "exhaustive"}     # no attention row searched alike
    assert [o.row for o in selection_overheads([attention, other])] == []
    assert compression_label(loose).endswith("bounded, then every entry in 96.9 % of the entries (loose bounds)")
    assert compression_label(tight).endswith("norms kernel, bounded (auto)")
    assert compression_label(attention | {"stage2_search": "exhaustive"}).endswith("every entry scored")


def test_a_pairs_verdict_reads_its_rounds_paired_in_order():
    """Each round's ratio pairs the two rows' i-th rounds, (P_a - C_a + C_p) / P_a where both timed their
    compression after each layer (a CPU's), the whole prefills' where the compression ran behind: met or missed
    only where every round is, undecided where the target lies between rounds, and the context's line takes its
    worst pair's verdict and names the pairs not met with their rounds' range."""
    from pcs.bench.tables import selection_overheads, targets

    def row(selection, prefills, compressions, budget=1024):
        return {"context": 4096, "method": "snapkv", "selection": selection, "budget": budget, "preset": None,
                "device": "cpu", "compression_layers_behind": 0, "prefill_s": statistics.median(prefills),
                "prefill_rounds_s": prefills, "compress_s": statistics.median(compressions),
                "compress_rounds_s": compressions, "decode_speedup": 1.0, "decode_bound": 1.0}
    attention = row("attention", [10.0, 10.0, 12.0], [0.1, 0.1, 0.3])
    straddles = row("perturbation", [10.2, 10.4, 12.0], [0.3, 0.5, 0.5])     # rounds 1.02, 1.04, 1.0167
    pair, = selection_overheads([attention, straddles])
    assert pair.round_ratios == pytest.approx([(10 - 0.1 + 0.3) / 10, (10 - 0.1 + 0.5) / 10, (12 - 0.3 + 0.5) / 12])
    assert pair.ratio == pytest.approx((10 - 0.1 + 0.5) / 10)    # the medians' ratio, above the target
    assert pair.verdict(1.03) == "undecided" and pair.verdict(1.05) == "met" and pair.verdict(1.01) == "missed"
    met = row("perturbation", [10.0] * 3, [0.2, 0.2, 0.4], budget=128)
    b128 = row("attention", [10.0, 10.0, 12.0], [0.1, 0.1, 0.3], budget=128)
    line = next(x for x in targets([attention, straddles, b128, met]) if x.startswith("perturbation over"))
    assert line.endswith("[target <= 1.03x: undecided] (by round: snapkv perturbation b1024 undecided "
                         "(1.017x-1.040x))")
    behind = [r | {"compression_layers_behind": 2} for r in (attention, straddles)]     # the whole prefills'
    assert selection_overheads(behind)[0].round_ratios == pytest.approx([10.2 / 10, 10.4 / 10, 12 / 12])
    behind[1]["prefill_rounds_s"] = [10.2, 10.4]      # unequal numbers of rounds: no pairing, the medians decide
    assert selection_overheads(behind)[0].round_ratios == []
    del straddles["compress_rounds_s"]          # an older file's row: the medians decide
    assert selection_overheads([attention, straddles])[0].round_ratios == []
    assert selection_overheads([attention, straddles])[0].verdict(1.03) == "missed"


def test_the_decode_bench_times_every_pool_against_its_bound(tiny_model_dir, capsys):
    """``--decode`` on a tiny model: a row per cache (the full one, each method x budget) and pool size, and a mixed
    pool per size; each row's bound is the weights a step reads (the untied input embedding aside) and its rows'
    own entries over the bandwidth measured, and a pool of n copies holds n times one copy's entries. ``--report``
    prints their table and names the targets these rows cannot judge."""
    main(["--decode", "--model-path", str(tiny_model_dir), "--contexts", "300", "--methods", "snapkv", "adakv",
          "--budgets", "64", "--pools", "1", "3", "--decode-tokens", "3", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    kinds = [(r["method"], r["budget"], r["pool"]) for r in rows]
    assert kinds == [("full", None, 1), ("full", None, 3), ("snapkv", 64, 1), ("snapkv", 64, 3), ("adakv", 64, 1),
                     ("adakv", 64, 3), ("mixed", None, 1), ("mixed", None, 3)]
    by = {k: r for k, r in zip(kinds, rows)}
    for (method, budget, _), row in by.items():
        assert not row["cuda_graphs"] and row["steps"] == 3 and row["tokens_per_s"] > 0
        assert row["ops_per_layer"] > 0 and row["ops_per_step"] == row["ops_per_layer"] * row["layers"]
        expected = 1000 * (row["weight_bytes"] + row["kv_bytes"]) / (row["bandwidth_gb_s"] * 1e9)
        assert row["bound_ms"] == pytest.approx(expected) and row["of_bound"] == pytest.approx(
            row["ms_per_step"] / row["bound_ms"])
        if method != "mixed":
            assert by[(method, budget, 3)]["kv_bytes"] == 3 * by[(method, budget, 1)]["kv_bytes"]
    assert by[("snapkv", 64, 1)]["kv_bytes"] < by[("full", None, 1)]["kv_bytes"]
    # a mixed pool of 3: the full cache, then the first two compressed rows of the sample (snapkv, adakv)
    assert by[("mixed", None, 3)]["kv_bytes"] == sum(by[(m, b, 1)]["kv_bytes"] for m, b in
                                                     [("full", None), ("snapkv", 64), ("adakv", 64)])
    assert by[("mixed", None, 3)]["rows_full"] == 1


def test_the_decode_report_reads_rows_against_the_decode_targets(tmp_path, capsys):
    """Hand-made decode rows: the full cache at 8K within 1.5x of its bound, a budget-128 row at 32K above 1.25x, a
    compressed row slower than the full cache, a pool of 64 with 30x batch 1's tokens per second, no mixed pool."""
    def row(method, budget, pool, context, ms, bound, tokens):
        return {"method": method, "budget": budget, "pool": pool, "context": context, "cuda_graphs": True,
                "ms_per_step": ms, "bound_ms": bound, "of_bound": ms / bound, "tokens_per_s": tokens,
                "bandwidth_gb_s": 3000.0}
    rows = [row("full", None, 1, 8192, 7.0, 5.0, 140.0), row("full", None, 1, 32768, 9.0, 6.0, 110.0),
            row("snapkv", 128, 1, 32768, 10.0, 5.0, 100.0), row("snapkv", 128, 64, 32768, 20.0, 14.0, 3000.0)]
    rows = [{**r, "decode_kernel": True, "compiled": True, "kernels_per_layer": 15.0} for r in rows]
    # the same configuration through masked attention, and uncompiled: shown, but the targets read the rows of the
    # engine's default, the kernel's and the compiled step's
    rows.append({**row("full", None, 1, 8192, 40.0, 5.0, 25.0), "decode_kernel": False, "compiled": True})
    rows.append({**row("full", None, 1, 8192, 9.0, 5.0, 110.0), "decode_kernel": True, "compiled": False,
                 "ops_per_layer": 40.0})
    path = tmp_path / "decode.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| 8192 | full | 1 | kernel | compiled | yes | 7.00 | 140.0 | 5.00 | 1.40 | 15 kernels |" in out
    assert "| 8192 | full | 1 | masked | compiled | yes | 40.00 | 25.0 | 5.00 | 8.00 | - |" in out
    assert "| 8192 | full | 1 | kernel | eager | yes | 9.00 | 110.0 | 5.00 | 1.80 | 40 ops |" in out
    assert "full cache, batch 1, at 8192: x1.40 of its bound [target <= 1.5: met]" in out
    assert "x2.00 to x2.00 of their bounds [target <= 1.25: missed]" in out
    assert "compressed steps slower than the full cache's from 8192: 1 of 1; 32768 snapkv b128 pool 1" in out
    assert "snapkv 30.0x batch 1's tokens/s, x1.43 of its bound [target >= 25x and <= x1.5: met]" in out
    assert "mixed pools: not measured" in out


def test_the_projection_prices_decoding_from_decode_rows(tmp_path, capsys):
    """Hand-made ``--decode`` rows, the same at 8K and 32K: batch 1 costs 10 ms (full), 4 ms (budget 128) and 6 ms
    (budget 1024), the largest mixed pool timed at both (8) 16 ms a step; a masked row the projection must not read
    (the kernel's rows stand), and a mixed pool of 64 timed at 8K alone, which it must not read either. Table 1's job per model: the full cache and SnapKV's two selections at budgets 128 to 1024, so a
    sample's answer costs, per token of its limit, 10 + 2 x (4 + 4 2/7 + 4 6/7 + 6) ms alone (budgets between two
    measured ones are linear in entries held) and 9 x 16 / 8 ms pooled."""
    from pcs.projection import DecodeCosts, sweep_configs, task_lengths

    def row(method, budget, pool, ms, kernel=True, context=8192):
        return {"method": method, "budget": budget, "pool": pool, "context": context, "cuda_graphs": True,
                "decode_kernel": kernel, "ms_per_step": ms, "bound_ms": 1.0, "of_bound": ms, "tokens_per_s": 1.0}
    rows = [row(m, b, p, ms, context=c) for c in (8192, 32768) for m, b, p, ms in
            (("full", None, 1, 10.0), ("snapkv", 128, 1, 4.0), ("snapkv", 1024, 1, 6.0), ("mixed", None, 1, 10.0),
             ("mixed", None, 8, 16.0))] + [row("full", None, 1, 100.0, kernel=False)]
    rows.append(row("mixed", None, 64, 64.0))        # at 8K only: pools are compared at a size timed everywhere
    steps = DecodeCosts(rows)
    assert steps.alone(None) == {8192: 10.0, 32768: 10.0}
    assert steps.alone(512)[8192] == pytest.approx(4 + 2 * 384 / 896)
    assert steps.pooled() == ({8192: 2.0, 32768: 2.0}, 8)
    decode_file, bench_file = tmp_path / "decode.jsonl", tmp_path / "bench.jsonl"
    decode_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench_file.write_text("".join(json.dumps({"method": "full", "selection": "none", "budget": None, "context": c,
                                              "prefill_s": 1.0, "decode_ms_per_token": 1.0}) + "\n"
                                  for c in (8192, 32768)))
    main(["--project", "experiment=table1", "--bench", str(bench_file), "--decode-bench", str(decode_file)])
    out = capsys.readouterr().out
    limits = sum(limit for _, limit in task_lengths(sweep_configs(["experiment=table1"])[0], 1.3))
    alone = limits * (10 + 2 * (4 + (4 + 2 * 128 / 896) + (4 + 2 * 384 / 896) + 6)) / 1000 / 3600
    pooled = limits * 9 * 16 / 8 / 1000 / 3600
    prefill = 3750 * 1.0 / 3600          # the full cache's prefill, 1 s a sample; no compression measured
    assert (f"| 0 | llama31 | 9 | 3750 | {prefill:.1f} | {alone:.1f} | {pooled:.1f} | {prefill + alone:.1f} | "
            f"{prefill + pooled:.1f} |") in out
    assert f"total: prefill {2 * prefill:.1f} h, decoding {2 * alone:.1f} h one at a time, {2 * pooled:.1f} h pooled" in out
