"""Fixed slots (``policy.slot_tokens``): every micro-batch exactly the slot, documents then a pad; and
the latency model prices a padded micro-batch as it runs: dense work at the slot's tokens, attention
on the documents alone."""

from __future__ import annotations

import numpy as np
import pytest
from policy_doubles import check_plan, make_ctx, random_batch

from sparsebalance.errors import ConfigError
from sparsebalance.policies.registry import make_batching, make_tuning
from sparsebalance.simulator.plan import MicroBatch, split_pad


@pytest.mark.parametrize("batching", ["lbb", "quadratic", "sab"])
@pytest.mark.parametrize("seed", range(4))
def test_slots_are_exact_and_every_document_is_placed_once(batching, seed):
    batch = random_batch(24, seed, lo=64, hi=4096)
    slot = 8192
    ctx = make_ctx(dp=2, pp=2, global_batch=24, slot_tokens=slot, min_microbatches=4, batching=batching)
    plan = make_batching(ctx.policy).plan(batch, ctx)
    check_plan(plan, batch, 2)
    assert plan.num_microbatches == 4
    for _, _, mb in plan.microbatches():
        assert mb.tokens == slot and mb.pad == slot - sum(s.length for s in mb.sequences) >= 0
        assert mb.lengths[-1] == -mb.pad if mb.pad else mb.lengths[-1] > 0
    budgets = make_tuning(ctx.policy).budgets(plan, ctx)  # DST tunes padded micro-batches
    assert len(budgets) == 2 and all(len(r) == 4 for r in budgets)


def test_a_batch_that_does_not_fit_or_a_document_longer_than_the_slot_is_refused():
    from sparsebalance.data.sequence import Sequence

    batch = [Sequence(id=i, length=3000) for i in range(8)]
    ctx = make_ctx(dp=2, global_batch=8, slot_tokens=4096, min_microbatches=2, batching="sab")
    with pytest.raises(ConfigError, match="do not pack"):
        make_batching(ctx.policy).plan(batch, ctx)
    long = [Sequence(id=i, length=5000 if i == 0 else 100) for i in range(8)]
    with pytest.raises(ConfigError, match="does not fit a slot"):
        make_batching(ctx.policy).plan(long, ctx)


@pytest.mark.parametrize("kw, field", [({"token_cap": 100}, "token_cap"), ({"batching": "sequential"}, "batching"),
                                       ({"batching": "sab", "tuning": "dst-cp"}, "tuning"),
                                       ({"slot_tokens": 0}, "slot_tokens")])
def test_slot_config_errors_name_the_field(kw, field):
    from sparsebalance.policies.config import PolicyConfig

    with pytest.raises(ConfigError, match=field):
        PolicyConfig(**{"slot_tokens": 4096, "batching": "lbb", **kw})


def test_split_pad():
    assert split_pad((5, 3, -8)) == ((5, 3), 16)
    assert split_pad((7,)) == ((7,), 7)
    mb = MicroBatch(sequences=(), pad=0)
    assert mb.lengths == () and mb.tokens == 0


def test_latency_prices_a_padded_microbatch_as_it_runs():
    """Oracle from the latency model's own per-op pieces: layers x (sum of the documents' attention
    + dense(slot)) + embedding(slot) + head(slot), per direction; every pricing path agrees."""
    from sparsebalance.runconfig import run_config_from_mapping
    from sparsebalance.runner import prepare

    cfg = run_config_from_mapping({"profile": "cpu-tiny", "model": {"preset": "tiny"},
                                   "cluster": {"device": "cpu", "pp": 2, "dp": 1, "global_batch": 8},
                                   "data": {"distribution": "chatqa2-like", "num_sequences": 16,
                                            "max_length": 1024}})
    lm = prepare(cfg).latency
    docs, pad, k = (700, 300, 90), 1000, 4
    lengths = (*docs, -pad)
    slot = sum(docs) + pad
    L = cfg.model.layers
    want = 0.0
    for bw in (False, True):
        want += (L * (sum(lm.attention(n, k, backward=bw) for n in docs) + lm.call[bw] + lm.dense(slot, backward=bw))
                 + lm.embed(slot, backward=bw) + lm.head(slot, backward=bw))
    assert lm.microbatch_latency(lengths, k) == pytest.approx(want, rel=1e-12)
    np.testing.assert_allclose(lm.microbatch_latencies([lengths, docs], [k, k])[0], want, rtol=1e-12)
    st = lm.stage_times([lengths], [k])
    scalar = [lm.stage_time(lengths, k, s, backward=bw) for bw in (False, True) for s in range(2)]
    np.testing.assert_allclose([*st["F"][:, 0], *st["B"][:, 0]], scalar, rtol=1e-12)
    assert sum(scalar) == pytest.approx(want, rel=1e-12)
    # the pad costs dense work only: more than the documents alone, less than a real document
    assert lm.microbatch_latency(docs, k) < want < lm.microbatch_latency((*docs, pad), k)
    assert lm.cp_tokens(lengths, k) == slot
