"""benchmarks/packed_decode_speed.py --smoke on the CPU: rows for every context and bit-width, each fused launch equal
to read-then-attend up to float rounding, the results file written; without CUDA the GPU run is one line. The launch
sweeps (on callables made slow, or wrong, on purpose): every launch timed and checked, a wrong one never the best."""

import json

import pytest
from benchmark_loader import load_benchmark



def load_script():
    return load_benchmark("packed_decode_speed")


def test_summary_takes_the_default_path_at_131k():
    """The bar per store and bit-width: the magic column where a row has it (the packed default), else fused; a
    row slower than bf16 fails it; rows at other contexts or without graph times are left out (hand-computed)."""
    script = load_script()

    def row(store, context, bits, **ms):
        return {"store": store, "context": context, "bits": bits, "ms_graph": {"bf16": 0.2, **ms}}

    rows = [row("packed", 131072, 4, fused=0.25, fused_magic=0.16), row("packed", 131072, 8, fused=0.3),
            row("packed", 65536, 4, fused=9.0, fused_magic=9.0), {"store": "packed", "context": 131072, "bits": 2}]
    got = script.summarize(rows)
    assert got["summary"] == {"packed_4bit_fused_magic_over_bf16_graph_at_131072": 0.8,
                              "packed_8bit_fused_over_bf16_graph_at_131072": 1.5}
    assert got["acceptance"] == {"default_decode_not_slower_than_bf16_at_131072": False}
    assert script.summarize(rows[:1])["acceptance"] == {"default_decode_not_slower_than_bf16_at_131072": True}
    assert script.summarize(rows[2:]) == {}


def test_smoke_rows_and_agreement(tmp_path, capsys):
    import torch

    script = load_script()
    out = tmp_path / "s.json"
    assert script.main(["--smoke", "--iters", "1", "--bits", "4,2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["bits"]) for r in rows] == [(64, 4), (64, 2), (128, 4), (128, 2)]
    assert all(r["max_abs_diff_fused_vs_read"] < 1e-5 and r["fused_over_bf16"] > 0 for r in rows)
    # every timed fused launch is checked against read_then_attend (here all the torch backend)
    assert all(r["max_abs_diff_fused_block_c_128_vs_read"] < 1e-5 and r["fused_block_c_128_over_bf16"] > 0
               for r in rows)
    names = {"bf16", "read_then_attend", "fused", "fused_block_c_128"}
    assert all(set(r["ms"]) == names for r in rows)
    assert script.main(["--smoke", "--iters", "1", "--bits", "2", "--store", "kivi", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]  # KIVI: window R = 128, so the 128-slot row has one quantized block
    assert [(r["store"], r["context"]) for r in rows] == [("kivi", 64), ("kivi", 128)]
    assert all(r["max_abs_diff_fused_vs_read"] < 1e-5 and r["max_abs_diff_fused_block_c_128_vs_read"] < 1e-5
               for r in rows)
    assert all(set(r["ms"]) == names for r in rows)
    if not torch.cuda.is_available():
        capsys.readouterr()
        assert script.main([]) == 2
        assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
def test_graph_replay_times_every_variant_on_cuda():
    """``--graph`` on CUDA: each variant captured in a CUDA graph and replayed, a positive time each."""
    import torch

    script = load_script()
    r = script.row(4096, 4, 8, 2, 128, iters=3, device=torch.device("cuda"), backend="triton", graph=True)
    assert all(isinstance(r["ms_graph"][k], float) and r["ms_graph"][k] > 0
               for k in ("bf16", "read_then_attend", "fused", "fused_magic"))
    assert r["fused_over_bf16_graph"] > 0 and r["fused_magic_over_bf16_graph"] > 0
    assert r["max_abs_diff_fused_magic_vs_fused"] < 1e-3  # the bf16 store: dequant="magic" is float32 rounding only


def test_launch_sweep_covers_the_grid_and_names_the_fastest():
    """The launch-grid sweep times every (block_c, split) with split from max(block_c, 128) to 8192 and at most 2048
    splits, and reports the fastest (its own times, here of callables made slow on purpose)."""
    import time

    import torch

    script = load_script()
    made = []

    def make(block_c, split):  # 32/1024 is the fastest but wrong, 64/1024 the fastest right one
        made.append((block_c, split))
        fast = (block_c, split) in ((64, 1024), (32, 1024))
        return (lambda: time.sleep(0.0 if fast else 0.002)), (0.5 if (block_c, split) == (32, 1024) else 1e-4)

    r = script.launch_sweep(make, 262144, iters=1, device=torch.device("cpu"), bf16_ms=1.0)
    expected = [(bc, sp) for bc in (32, 64, 128) for sp in (128, 256, 512, 1024, 2048, 4096, 8192)
                if 262144 // sp <= 2048]
    assert made == expected and set(r["sweep"]) == {f"{bc}/{sp}" for bc, sp in expected}
    assert set(r["sweep_max_abs_diff"]) == set(r["sweep"]) and r["sweep_max_abs_diff"]["32/1024"] == 0.5
    assert r["sweep_wrong"] == ["32/1024"]
    assert r["sweep_best"] == "64/1024" and r["sweep_best_over_bf16_graph"] == round(r["sweep"]["64/1024"], 3)


def test_kivi_launch_sweep_times_every_variant_and_reports_failures():
    """The KIVI sweep times each variant of KIVI_SWEEP (the kernel's key paths and launches, no tile under 32) at the
    default split times its factor, names it ``key_path/block_c/split/warps/stages``, gives each ratio to the bf16
    time and its difference from read_then_attend, reports a launch that raises instead of stopping, and lists a
    launch further than MAX_ABS_DIFF (or NaN) as wrong, never the best."""
    import time

    import torch

    script = load_script()
    made = []

    def make(**launch):
        made.append(launch)
        if launch["block_c"] == 128 and launch["num_warps"] == 8:
            raise RuntimeError("out of resources: shared memory\nmore")
        # tiles of 64 are the fastest; broadcast's are wrong (one off, one NaN), gather's right
        wrong = {(64, 4): 0.19, (64, 8): float("nan")} if launch["key_path"] == "broadcast" else {}
        diff = wrong.get((launch["block_c"], launch["num_warps"]), 1e-4)
        return (lambda: time.sleep(0.0 if launch["block_c"] == 64 else 0.002)), diff

    variants = script.KIVI_SWEEP
    r = script.kivi_launch_sweep(make, 131072, 8, iters=1, device=torch.device("cpu"), bf16_ms=1.0)
    assert [(m["key_path"], m["block_c"], m["num_warps"], m["num_stages"]) for m in made] == \
        [v[:4] for v in variants]
    assert {v[0] for v in variants} == {"broadcast", "gather"} and min(v[1] for v in variants) == 32
    assert variants[0][:4] == ("broadcast", 32, 4, 2)  # the default launch first
    default = script.default_split(131072, 8, 32, torch.device("cpu"))
    assert [m["split"] for m in made[:3]] == [default, default // 2, default * 2]
    assert len(r["sweep"]) == len(variants)
    failed = [k for k, v in r["sweep"].items() if isinstance(v, str)]
    assert len(failed) == 1 and failed[0].startswith("broadcast/128/") and "out of resources" in r["sweep"][failed[0]]
    assert set(r["sweep_over_bf16_graph"]) == set(r["sweep_max_abs_diff"]) == set(r["sweep"]) - set(failed)
    assert sorted(r["sweep_wrong"]) == sorted(k for k in r["sweep"] if k.startswith("broadcast/64/"))
    assert len(r["sweep_wrong"]) == 2
    assert r["sweep_best"].startswith("gather/64/")


def test_packed_launch_sweep_times_tiles_warps_stages_and_splits():
    """The packed warps sweep builds every launch of PACKED_SWEEP (the default first) with its split from the
    default, reports a launch that fails, never names a wrong one the best, and names the fastest right one."""
    import time

    import torch

    script = load_script()
    made = []

    def make(**launch):
        made.append(launch)
        if launch["num_warps"] == 8 and launch["num_stages"] == 4:
            raise RuntimeError("out of resources: shared memory\nmore")
        diff = 0.5 if (launch["num_warps"], launch["num_stages"]) == (2, 1) else 1e-4
        fast = (launch["block_c"], launch["num_warps"], launch["num_stages"]) in ((128, 2, 1), (64, 8, 3))
        return (lambda: time.sleep(0.0 if fast else 0.002)), diff

    variants = script.PACKED_SWEEP
    r = script.packed_launch_sweep(make, 131072, 8, iters=1, device=torch.device("cpu"), bf16_ms=1.0)
    assert variants[0] == (64, 4, 2, 1)  # the default launch first
    assert {v[1] for v in variants} == {2, 4, 8} and {v[2] for v in variants} == {1, 2, 3, 4}
    assert [(m["block_c"], m["num_warps"], m["num_stages"]) for m in made] == [v[:3] for v in variants]
    default = script.default_split(131072, 8, 64, torch.device("cpu"))
    assert made[0]["split"] == default and made[1]["split"] == default // 2
    failed = [k for k, v in r["sweep"].items() if isinstance(v, str)]
    assert failed and all(k.endswith("/8/4") and "out of resources" in r["sweep"][k] for k in failed)
    assert all(k.endswith("/2/1") for k in r["sweep_wrong"]) and r["sweep_wrong"]
    assert r["sweep_best"].startswith("64/") and r["sweep_best"].endswith("/8/3")  # (128, 2, 1) is fast but wrong


def test_kivi_launch_sweep_without_a_right_launch_names_no_best():
    """When every launch is further than MAX_ABS_DIFF from read_then_attend, all are wrong and none is the best."""
    import torch

    script = load_script()
    r = script.kivi_launch_sweep(lambda **launch: ((lambda: None), 1.0), 4096, 8, iters=1,
                                 device=torch.device("cpu"), bf16_ms=1.0, variants=script.KIVI_SWEEP[:2])
    assert len(r["sweep_wrong"]) == 2 and "sweep_best" not in r


@pytest.mark.gpu
def test_launch_sweep_on_cuda_agrees_with_the_default_launch():
    """On CUDA every launch of the sweep gives the default launch's output (same codes, different split only)."""
    import torch

    from kvlearn.cache import PackedStore
    from kvlearn.ops.packed_decode import packed_decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(1, 2, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    q = torch.randn(1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    store = PackedStore(4)
    store.allocate(1, 2, 4096, 128, 128, torch.bfloat16, torch.device("cuda"))
    store.write(torch.arange(4096, device="cuda").expand(1, 2, 4096), k, v)
    visible = torch.ones(1, 1, 4096, dtype=torch.bool, device="cuda")
    args = (q, store.key_codes, store.key_scales, store.value_codes, store.value_scales, visible, 4)
    ref = packed_decode_attention(*args, backend="triton")
    for block_c, split in ((32, 128), (64, 256), (128, 1024), (64, 4096)):
        out = packed_decode_attention(*args, backend="triton", block_c=block_c, split=split)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=0)
    for block_c, warps, stages in ((64, 2, 1), (64, 8, 3), (128, 4, 4), (128, 8, 2)):  # the warps sweep's launches
        for dequant in ("convert", "magic"):
            out = packed_decode_attention(*args, backend="triton", block_c=block_c, num_warps=warps,
                                          num_stages=stages, dequant=dequant)
            torch.testing.assert_close(out, ref, atol=2e-3, rtol=0)


@pytest.mark.gpu
def test_warps_sweep_of_the_magic_path_on_cuda():
    """``--sweep-warps --sweep-dequant magic``: the sweep times the magic path's launches, records which path it
    swept, and finds a right launch (each checked against read_then_attend)."""
    import torch

    script = load_script()
    r = script.row(8192, 4, 8, 2, 128, iters=2, device=torch.device("cuda"), backend="triton", graph=True,
                   sweep="warps", sweep_dequant="magic")
    assert r["sweep_dequant"] == "magic" and r["sweep_best"] and not r["sweep_wrong"]
