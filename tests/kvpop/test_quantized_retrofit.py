"""The KVpop retrofit under quantized keys and values (``RetrofitConfig.kv_bits``, ``kvlearn retrofit --kv-bits``):
the training attention attends the stored form a ``kaizen+kvpop`` cache holds at that precision, so a student
retrofitted so decodes through that cache as it trained (rule 4), its scorers reading full-precision keys as the
cache's scorers do; the trainer runs it and refuses bad bit-widths in one line. Tiny random GQA Qwen3 (3 layers,
2 KV heads, 2 query heads per KV head, head_dim 128), float32."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kaizen"))
from test_compose import eviction_config, ids_of, run, tiny, with_kvpop  # noqa: E402

from kvlearn import KVLearnError  # noqa: E402
from kvlearn.kaizen import sharing  # noqa: E402
from kvlearn.kaizen.actions import Backbone, KaizenConfig, LayerAction  # noqa: E402
from kvlearn.kaizen.compose import ComposedConfig  # noqa: E402
from kvlearn.kvpop.train_attention import TrainForward, use_train_attention  # noqa: E402
from kvlearn.methods import get_method  # noqa: E402


def training_logits(model, config, ids, kv_bits):
    """The full-sequence training forward under the running top-k, attending K/V at ``kv_bits`` per layer."""
    use_train_attention(model)
    state = TrainForward(config, kv_bits)
    with torch.no_grad():
        logits = model(input_ids=ids, kvpop_train=state, use_cache=False).logits
    sharing.attach(model)  # back to the cache's attention
    return logits, state


def composed_student(bits, evict, dtype, n=100):
    """A tiny model under ``evict`` (KVpop, random scorers) in the ``kaizen+kvpop`` configuration ``bits`` (per layer
    a width or ``"share"``): ``(model, evict, new_cache, ids [2, n])``, ``new_cache()`` a fresh composed cache."""
    model = tiny(11).to(dtype)
    backbone = Backbone.from_config(model.config)
    choice = KaizenConfig(backbone, tuple(LayerAction.shared() if b == "share" else LayerAction(b) for b in bits))
    config = ComposedConfig(choice.compression(metadata=False) * evict.context / evict.budget, evict)
    method = get_method("kaizen+kvpop")
    method.prepare(model, config)
    with_kvpop(model, evict)
    return model, evict, lambda: method.make_choice_cache(config, model, choice, 0), ids_of(2, n)


@pytest.mark.parametrize("bits,dtype,tol", [((4, 4, 4), torch.float32, 1e-4), ((4, 4, 4), torch.float64, 1e-10),
                                            ((8, 2, 4), torch.float64, 1e-10), ((4, "share", 2), torch.float32, 1e-4),
                                            ((8, "share", "share"), torch.float64, 1e-10)],
                         ids=["b4-f32", "b4-f64", "b8-b2-b4-f64", "b4-share-b2-f32", "b8-share-share-f64"])
def test_quantized_training_forward_equals_decoding_through_the_composed_cache(bits, dtype, tol):
    """Rule 4 for a student retrofitted under quantized K/V: the logits of the training forward (running top-k of the
    scorers on full-precision keys, attention over fake-quantized K/V) equal prefill (chunks of 16) + token-by-token
    decoding through the ``kaizen+kvpop`` cache of the same precisions (packed stores, KVpop's policy), for a
    sequence 2.5x the budget; a ``"share"`` layer attends its anchor's quantized K/V under the anchor's retention, as
    the cache's sharing layer reads its anchor's evicted store. Mixed precisions with 8 bits are checked in float64:
    in float32 the one-matmul and the token-by-token keys differ in their last bits, and at 8 bits (steps of
    absmax / 127) such a difference sometimes crosses a rounding boundary of the quantizer, one code apart, which
    moves a few logits past 1e-4."""
    prompt = 36
    model, evict, new_cache, ids = composed_student(bits, eviction_config("kaizen+kvpop", 40, 256), dtype)
    want, _ = training_logits(model, evict, ids, bits)
    got = run(model, new_cache(), ids, prompt, dense=False)
    torch.testing.assert_close(got, want[:, prompt - 1:], atol=tol, rtol=tol)
    plain, state = training_logits(model, evict, ids, None)
    assert (plain[:, prompt - 1:] - want[:, prompt - 1:]).abs().max() > 1e-3  # the quantization is visible
    _, quantized = training_logits(model, evict, ids, bits)
    assert sorted(quantized.records) == [l for l, b in enumerate(bits) if b != "share"]  # sharing layers score nothing


@pytest.mark.parametrize("bits", [(4, 4, 4), (4, "share", 2)], ids=["b4", "b4-share-b2"])
def test_mlstm_student_under_quantized_kv_decodes_as_it_trains_at_every_prefill_chunk(bits):
    """Rule 4 for the mLSTM scorer with its delayed readout, float64: the composed cache reads a token back from its
    (quantized) store when the token leaves the window, so the training forward's readout reads the stored form too
    (``read_key``), and the cache reads a prefill chunk's own tokens in that form as well. The training forward's
    logits equal prefill + decoding through the ``kaizen+kvpop`` cache at prefill chunks of 4, 16 and 64 (before,
    the readout read full-precision tokens within a chunk and stored ones across chunks: the logits moved by ~0.2
    with the chunk size and differed from training by as much)."""
    from kvlearn.config import KVpopConfig

    prompt = 60
    evict = KVpopConfig(sinks=2, window=8, topk=30, context=256, scorer="mlstm")
    model, evict, new_cache, ids = composed_student(bits, evict, torch.float64)
    assert_chunked_decoding_equals_training(model, evict, new_cache, ids, bits, prompt)


def assert_chunked_decoding_equals_training(model, evict, new_cache, ids, bits, prompt, each_cache=None):
    """Prefill ``ids[:, :prompt]`` in chunks of 4, 16 and 64 through ``new_cache()`` (``each_cache(cache, chunk)``
    first, and after), then decode the rest one token a forward: the logits equal the training forward's to 1e-10."""
    from kvlearn.cache.prefill import prefill

    want, _ = training_logits(model, evict, ids, bits)
    for chunk in (4, 16, 64):
        cache = new_cache()
        if each_cache is not None:
            each_cache(cache, chunk)
        with torch.no_grad():
            got = [prefill(model, cache, ids[:, :prompt], chunk_size=chunk, dense=False)[:, None]]
            got += [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                    for t in range(prompt, ids.shape[1])]
        torch.testing.assert_close(torch.cat(got, dim=1), want[:, prompt - 1:], atol=1e-10, rtol=1e-10,
                                   msg=f"prefill chunk {chunk}")
        if each_cache is not None:
            each_cache(None, chunk)


def test_quantized_attention_keeps_the_scorers_on_full_precision_keys_and_passes_gradients():
    """Layer 0's scores, ranks and cutoffs are those of the unquantized forward (its scorer reads the same
    full-precision keys); the backbone still gets gradients through the quantized attention (straight-through)."""
    model = tiny(12)
    evict = eviction_config("kaizen+kvpop", 40, 256)
    get_method("kaizen+kvpop").prepare(model, ComposedConfig(6.4, evict))
    with_kvpop(model, evict)
    ids = ids_of(2, 90)
    _, quant = training_logits(model, evict, ids, (2, 2, 2))
    _, plain = training_logits(model, evict, ids, None)
    for field in ("priorities", "ranks", "cutoffs"):
        torch.testing.assert_close(getattr(quant.records[0], field), getattr(plain.records[0], field))
    use_train_attention(model)
    model.zero_grad()
    model(input_ids=ids, kvpop_train=TrainForward(evict, (2, 2, 2)), use_cache=False).logits.square().mean().backward()
    assert float(model.model.layers[0].self_attn.k_proj.weight.grad.abs().sum()) > 0
    sharing.attach(model)


def test_a_student_retrofitted_under_a_configuration_serves_under_it(tmp_path, capsys):
    """``kvlearn retrofit --kv-bits 4,share,2`` records ``b4 share b2`` (8x) in the student's config.json;
    ``kvlearn eval --method kaizen+kvpop`` on it takes that configuration (not the static one) at a total target its
    8x meets (8 x 256 / 40 = 51.2), and a total target that needs more from the representation is one line naming the
    recorded configuration."""
    import json

    from kvlearn.cli import main

    teacher = tmp_path / "teacher"
    tiny(14).save_pretrained(teacher)
    out = tmp_path / "student"
    assert main(["retrofit", "--model", str(teacher), "--out", str(out), "--kv-bits", "4,share,2", "--budget", "40",
                 "--sinks", "2", "--window", "8", "--steps", "2", "--batch-size", "2", "--seq-len", "128",
                 "--device", "cpu"]) == 0
    assert json.loads((out / "final" / "config.json").read_text())["kvpop_kv_configuration"] == "b4 share b2"
    rows = tmp_path / "rows.json"
    assert main(["eval", "--model", str(out / "final"), "--method", "kaizen+kvpop", "--budget", "40", "--sinks", "2",
                 "--target", "51.2", "--context", "256", "--tasks", "vt", "--n-per-task", "2", "--device", "cpu",
                 "--out", str(rows)]) == 0
    (row,) = json.loads(rows.read_text())["rows"]
    assert row["configurations"] == {"b4 share b2": 2} and row["factor"] == pytest.approx(51.2)
    capsys.readouterr()
    code = main(["eval", "--model", str(out / "final"), "--method", "kaizen+kvpop", "--budget", "40", "--sinks", "2",
                 "--target", "64", "--context", "256", "--tasks", "vt", "--n-per-task", "1", "--device", "cpu"])
    err = capsys.readouterr().err  # the progress bars, then one error line (no traceback)
    (line,) = [ln for ln in err.splitlines() if "kvlearn: error:" in ln]
    assert code == 2 and "Traceback" not in err and "retrofitted under 'b4 share b2' (8x): ask for at most 51.2x" in line


def test_retrofit_under_kv_bits_runs_and_bad_bits_are_one_line(tmp_path):
    """``kvlearn retrofit --kv-bits 4`` trains 2 steps and records the bits for a resume; a resume with other bits,
    bits outside {2, 4, 8, 16}, a per-layer list of the wrong length and --kv-bits with another method are one line."""
    from kvlearn.cli import main
    from kvlearn.train.distill import RetrofitConfig, retrofit

    teacher = tmp_path / "teacher"
    tiny(13).save_pretrained(teacher)
    common = dict(model=str(teacher), steps=2, batch_size=2, seq_len=128, save_interval=1, warmup_steps=0,
                  kvpop=eviction_config("kaizen+kvpop", 40, None), kv_bits=4)
    result = retrofit(RetrofitConfig(out=str(tmp_path / "run"), **common), progress=False)
    assert result["step"] == 2 and torch.load(Path(result["final"]) / "trainer_state.pt",
                                              weights_only=False)["config"]["kv_bits"] == 4
    with pytest.raises(KVLearnError, match="kv_bits=4 but this run has kv_bits=2"):
        retrofit(RetrofitConfig(out=str(tmp_path / "run"), resume=True, **{**common, "kv_bits": 2}),
                 progress=False)
    for bad, match in ((3, r"kv_bits=3 is invalid: expected bit-widths in \{2, 4, 8, 16\}"),
                       (("share", 4, 4), r"kv_bits=\('share', 4, 4\) is invalid"),
                       ((4, 4), "kv_bits lists 2 bit-widths for a model of 3 layers")):
        with pytest.raises(KVLearnError, match=match) as err:
            retrofit(RetrofitConfig(out=str(tmp_path / f"bad{bad}"), **{**common, "kv_bits": bad}), progress=False)
        assert len(str(err.value).splitlines()) == 1
    code = main(["retrofit", "--model", str(teacher), "--out", str(tmp_path / "cli"), "--method", "dms",
                 "--budget", "40", "--window", "8", "--kv-bits", "4", "--steps", "1", "--seq-len", "128"])
    assert code == 2
    code = main(["retrofit", "--model", str(teacher), "--out", str(tmp_path / "cli"), "--kv-bits", "four",
                 "--budget", "40", "--window", "8", "--steps", "1", "--seq-len", "128"])
    assert code == 2
