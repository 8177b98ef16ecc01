"""Shared by the fused loss's run-time-choice tests: a small head (64 x 48 x 256) priced like the
Llama-3 head on the H200, with small tiles, and the default kept-fraction store emptied for each test."""

import dataclasses

import pytest

import comera_compile.kernels.linear_cross_entropy as lce
from comera_compile.cce import (cce_tuning, current_kept_fraction_store, default_kept_fraction_store,
                                reset_kept_fractions)
from comera_compile import devices

N, D, V = 64, 48, 256  # D > fused_max_d would be slow here; 48 keeps the fused path out of "chunked"
# Rates under which this small head prices like the Llama-3 head on the H200 (FLOP-bound, no fixed
# costs): flat logits pick "chunked", a kept fraction below ~0.22 picks "sparse".
SCALED = dataclasses.replace(devices.H200, name="H200, scaled to a 64 x 48 x 256 head", cce_softmax_elems=1e30,
                             hbm_bandwidth=1e30, cce_launch_s=0.0, cce_sync_s=0.0, sparse_round_s=0.0,
                             sparse_call_s=0.0, forward_bounds_s=0.0)
SMALL_TILES = dict(fwd_block_m=16, fwd_block_n=32, fwd_block_k=16, bwd_block_m=16, bwd_block_n=16,
                   bwd_block_k=16, cons_block_d=16, group_v=2, fwd_group_m=2, dense_block_n=32,
                   fused_block_m=16, fused_block_n=32)


@pytest.fixture(autouse=True)
def _fresh_observations():
    """The tests run on the default store (today's behaviour of a caller that chose none), emptied
    before and after; no test leaves a store of its own current."""
    assert current_kept_fraction_store() is default_kept_fraction_store()
    reset_kept_fractions()
    yield
    reset_kept_fractions()
    assert current_kept_fraction_store() is default_kept_fraction_store()


@pytest.fixture
def scaled_rates(monkeypatch):
    """The op (public function and run-time choice) prices its Triton paths at SCALED; small tiles,
    so that this head has 4 x 16 gradient tiles."""
    real = lce.cce.op_profile  # the op reads comera_compile.cce.op_profile when it runs
    monkeypatch.setattr(lce.cce, "op_profile",
                        lambda device, *, triton: SCALED if triton else real(device, triton=False))
    monkeypatch.setenv("COMERA_FORCE_TRITON", "1")
    with cce_tuning(**SMALL_TILES) as tuning:
        yield tuning
