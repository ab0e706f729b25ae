"""Per-kernel launch configurations (kernels/moba/launch.py): the chosen table, its candidates, the
fallback of a device the table was not chosen for (said once), overrides for tuning, and the tile
constraints the plan relies on. CPU only: the CUDA device queries are replaced."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from sparsebalance.kernels.moba import launch, triton_impl


def test_every_kernel_has_a_chosen_config_among_its_candidates():
    for name in launch.KERNELS:
        for d in (64, 128):
            c = launch.CHOSEN[(name, d)]
            assert c in launch.CANDIDATES[name], (name, d)
            cfg = launch.Config.parse(c)
            assert cfg.label() == c and cfg.block_m & (cfg.block_m - 1) == 0 and cfg.warps in (4, 8)
    assert launch.chosen("bwd_kv", 96).label() == launch.CHOSEN[("bwd_kv", 128)]  # nearest head dim
    assert {"by", "target", "triton", "date"} <= set(launch.CHOSEN_FOR)


@pytest.mark.parametrize("capability,smem,why", [((8, 0), 232448, "older than the sm_90a"),
                                                 ((9, 0), 16384, "shared memory")])
def test_a_device_the_table_was_not_chosen_for_falls_back_and_says_so_once(monkeypatch, capability, smem, why):
    class Props:
        shared_memory_per_block_optin = smem

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    monkeypatch.setattr(launch, "_warned", set())
    dev = torch.device("cuda", 0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = launch.config("bwd_kv", 128, dev)
        again = launch.config("bwd_kv", 128, dev)
    assert first == again == launch.FALLBACK
    assert len(seen) == 1 and why in str(seen[0].message) and "falling back to 32x32x4x1" in str(seen[0].message)
    assert launch.config("bwd_kv", 128, torch.device("cpu")) == launch.chosen("bwd_kv", 128)  # no device query


def test_an_override_applies_inside_the_block_only():
    before = launch.chosen("fwd_past", 128)
    with launch.override({"fwd_past": "128x32x8x2"}):
        assert launch.chosen("fwd_past", 128).label() == "128x32x8x2"
        cfg = triton_impl.configs(256, 128, torch.device("cpu"))
        assert cfg["fwd_past"].block_m == 128 == cfg["bwd_dq_past"].block_m  # dQ walks the forward's items
    assert launch.chosen("fwd_past", 128) == before


def test_tiles_are_capped_at_the_block_and_the_dq_kernels_share_the_forward_rows():
    cfg = triton_impl.configs(16, 64, torch.device("cpu"), block_m=8, block_n=8)
    for name in ("fwd_past", "fwd_own_merge", "bwd_kv", "bwd_dq_own", "bwd_dq_past"):
        assert cfg[name].block_m == 8 and cfg[name].block_n == 8, name
    big = triton_impl.configs(32, 128, torch.device("cpu"))
    assert all(big[n].block_m <= 32 and big[n].block_n <= 32 for n in launch.KERNELS if n != "gate")
    assert big["bwd_dq_own"].block_m == big["fwd_own_merge"].block_m
