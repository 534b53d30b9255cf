"""bench.store_tiers runs end to end and reports every row against its baselines (figures
are not checked: tests never time things)."""
import json

from bench.store_tiers import main, paired_times


def test_paired_times_runs_each_side_in_a_rotating_order():
    order = []
    fns = [lambda k=k: order.append(k) for k in "abc"]
    t, base = paired_times(fns[0], fns[1:], reps=3, before=[lambda: None] * 3)
    assert len(base) == 2 and t >= 0 and min(base) >= 0
    rounds = [order[3 + 3 * r: 6 + 3 * r] for r in range(3)]  # after the warm-up a, b, c
    assert rounds == [list("abc"), list("bca"), list("cab")]


def test_the_quick_bench_reports_every_tier_against_its_baselines(tmp_path):
    out = tmp_path / "tiers.json"
    main(["--quick", "--mib", "1", "--dir", str(tmp_path), "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    ssd_put = [r for r in rows if r["case"] == "ssd put 1MiB single"]
    assert {r["baseline"] for r in ssd_put} == {"plain file", "plain file + xxh3"}
    assert any(r["case"] == "ssd cold get 256KiB batched x16" for r in rows)
    assert all(r["value"] > 0 and (r["baseline"] is None or r["ratio"] > 0) for r in rows)
    assert list(tmp_path.iterdir()) == [out]  # the tier directories and files are gone
