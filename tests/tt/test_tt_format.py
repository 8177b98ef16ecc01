"""TT / TT-matrix format math (comera_compile/tt/format.py) and the comera::tt_materialize op.

Every numeric check compares against ``reference_weight`` below: a float64 einsum over the full
index tensor, written from DESIGN.md's definition and sharing no code with the implementation.
"""

import math

import pytest
import torch

from comera_compile import tt
from comera_compile.kernels.tt_materialize import tt_materialize
from comera_compile.tt import TTSpec


def reference_weight(cores, gates, fmt, row_modes, col_modes, rows, cols, transpose):
    """DESIGN.md's definition, index by index: T[i.., o..] = G1[:, i1, :] g1 G2[:, i2, :] ..."""
    acc = torch.ones(1, dtype=torch.float64)
    for k, core in enumerate(cores):
        core = core.to(torch.float64)
        if fmt == "tt":
            acc = torch.einsum("...a,asb->...sb", acc, core)
        else:
            acc = torch.einsum("...a,amnb->...mnb", acc, core)
        if k < len(gates):
            acc = acc * gates[k].to(torch.float64)
    acc = acc[..., 0]
    if fmt == "ttm":
        d = len(row_modes)
        acc = acc.permute(list(range(0, 2 * d, 2)) + list(range(1, 2 * d, 2)))
    full = acc.reshape(math.prod(row_modes), math.prod(col_modes))
    m = full[:rows, :cols]
    return m.t() if transpose else m


def _modes_for(fmt, n_cores, seed, limit=120):
    """Small mode lists (1s, 2s and 3s) for ``n_cores`` cores, each side's product <= ``limit``."""
    g = torch.Generator().manual_seed(seed)

    def pick(n):
        modes = [int(v) for v in torch.randint(1 if fmt == "ttm" else 2, 4, (n,), generator=g)]
        while math.prod(modes) > limit:
            modes[modes.index(max(modes))] -= 1
        return tuple(modes)

    if fmt == "tt":
        a = max(1, n_cores // 2 - (seed % 2))
        return pick(a), pick(n_cores - a)
    return pick(n_cores), pick(n_cores)


def _random_layer(fmt, n_cores, seed, transpose, dtype=torch.float64, rank=4):
    row_modes, col_modes = _modes_for(fmt, n_cores, seed)
    P, Q = math.prod(row_modes), math.prod(col_modes)
    rows, cols = max(1, P - seed % 3), max(1, Q - (seed + 1) % 2)  # odd sizes: padding is cropped
    sizes = tt.core_sizes(fmt, row_modes, col_modes)
    g = torch.Generator().manual_seed(100 + seed)
    ranks = [1] + [int(v) for v in torch.randint(1, rank + 1, (n_cores - 1,), generator=g)] + [1]
    spec = TTSpec(fmt, row_modes, col_modes, tt.cap_ranks(sizes, ranks), rows, cols, transpose)
    cores = [torch.randn(s, dtype=dtype, generator=g) for s in spec.core_shapes]
    gates = [torch.rand(r, dtype=dtype, generator=g) + 0.5 for r in spec.gate_sizes]
    return spec, cores, gates


CASES = [(fmt, n, tr) for fmt in ("tt", "ttm") for n in range(2, 9) for tr in (False, True)]


@pytest.mark.parametrize("fmt,n_cores,transpose", CASES)
def test_materialize_matches_reference(fmt, n_cores, transpose):
    spec, cores, gates = _random_layer(fmt, n_cores, seed=n_cores, transpose=transpose,
                                       dtype=torch.float32)
    want = reference_weight(cores, gates, *spec.op_args())
    for got in (tt.materialize(cores, gates, spec), tt_materialize(cores, gates, *spec.op_args())):
        assert got.shape == spec.weight_shape and got.is_contiguous()
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt,n_cores,transpose", CASES)
def test_gradients_match_float64_autograd_of_reference(fmt, n_cores, transpose):
    spec, cores, gates = _random_layer(fmt, n_cores, seed=n_cores + 7, transpose=transpose)
    params = [t.clone().requires_grad_() for t in cores + gates]
    d = len(cores)
    out = tt_materialize(params[:d], params[d:], *spec.op_args())
    probe = torch.randn_like(out)
    got = torch.autograd.grad((out * probe).sum(), params)
    ref_params = [t.clone().requires_grad_() for t in cores + gates]
    ref = reference_weight(ref_params[:d], ref_params[d:], *spec.op_args())
    want = torch.autograd.grad((ref * probe).sum(), ref_params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("fmt,n_cores,transpose", [("tt", 2, True), ("tt", 3, False),
                                                   ("ttm", 1, False), ("ttm", 2, True),
                                                   ("ttm", 3, False)])
def test_gradcheck(fmt, n_cores, transpose):
    """First and second derivatives (the backward is written in differentiable torch ops)."""
    spec, cores, gates = _random_layer(fmt, n_cores, seed=3, transpose=transpose, rank=3)
    params = [t.requires_grad_() for t in cores + gates]
    d = len(cores)

    def fn(*p):
        return tt_materialize(p[:d], p[d:], *spec.op_args())

    assert torch.autograd.gradcheck(fn, params)
    assert torch.autograd.gradgradcheck(fn, params)


@pytest.mark.parametrize("fmt,transpose", [("tt", True), ("ttm", False)])
def test_opcheck(fmt, transpose):
    """Schema, fake (shapes, strides), autograd registration, and AOT dispatch."""
    spec, cores, gates = _random_layer(fmt, 3, seed=5, transpose=transpose, dtype=torch.float32)
    core_flat = torch.cat([c.reshape(-1) for c in cores]).requires_grad_()
    gate_flat = torch.cat([g.reshape(-1) for g in gates]).requires_grad_()
    torch.library.opcheck(torch.ops.comera.tt_materialize.default,
                          (core_flat, gate_flat, spec.fmt, list(spec.row_modes), list(spec.col_modes),
                           list(spec.ranks), spec.rows, spec.cols, spec.transpose))


def test_zero_rank_bond_gives_a_zero_weight():
    """After pruning a bond to rank 0 the layer is a zero layer, not a crash (rank adaptation)."""
    spec = TTSpec("tt", (3, 2), (2, 3), (1, 3, 0, 2, 1), 5, 6, True)
    cores = [torch.randn(s, requires_grad=True) for s in spec.core_shapes]
    gates = [torch.ones(r, requires_grad=True) for r in spec.gate_sizes]
    w = tt_materialize(cores, gates, *spec.op_args())
    assert w.shape == (6, 5) and not w.any()
    w.sum().backward()
    assert all(c.grad is not None and c.grad.shape == c.shape for c in cores)


def test_comera_parameter_counts():
    """CoMERA's reference layouts and their parameter counts (cores only)."""
    def counted(fmt, row_modes, col_modes, rank):
        sizes = tt.core_sizes(fmt, row_modes, col_modes)
        ranks = tt.cap_ranks(sizes, tt.normalize_ranks(rank, len(sizes)))
        spec = TTSpec(fmt, row_modes, col_modes, ranks, math.prod(row_modes), math.prod(col_modes))
        return ranks, tt.count_params(spec.core_shapes, include_gates=False), spec

    ranks, n, _ = counted("tt", (12, 8, 8), (8, 8, 12), 30)
    assert ranks == (1, 12, 30, 30, 30, 12, 1) and n == 20_448
    ranks, n, _ = counted("tt", (12, 8, 8), (12, 16, 16), 30)
    assert ranks == (1, 12, 30, 30, 30, 16, 1) and n == 28_960
    ranks, n, spec = counted("ttm", (16, 20, 10, 10), (4, 4, 8, 6), 32)
    assert ranks == (1, 32, 32, 32, 1) and n == 167_808
    # 4-D cores: r_{k-1} * m_k * n_k * r_k each (the reference code undercounts these).
    assert n == sum(a * m * c * b for a, m, c, b in spec.core_shapes)
    assert spec.num_params == n + 3 * 32  # gates: one per internal bond


def test_rank_capping_and_normalization():
    sizes = (12, 8, 8, 8, 8, 12)
    assert tt.rank_bounds(sizes) == (1, 12, 96, 768, 96, 12, 1)
    assert tt.cap_ranks(sizes, (1, 100, 100, 100, 100, 100, 1)) == (1, 12, 96, 100, 96, 12, 1)
    # Beyond r_{k-1} * s_k a bond spans nothing new.
    assert tt.cap_ranks((4, 4, 4, 4), (1, 2, 30, 2, 1)) == (1, 2, 8, 2, 1)
    assert tt.normalize_ranks(5, 3) == (1, 5, 5, 1)
    assert tt.normalize_ranks([2, 3], 3) == (1, 2, 3, 1)
    assert tt.normalize_ranks([1, 2, 3, 1], 3) == (1, 2, 3, 1)
    for bad in (0, -1, [2], [2, 3, 4], [0, 3], [2, 2, 3, 1], 2.5, "8", [True, 2]):
        with pytest.raises(ValueError):
            tt.normalize_ranks(bad, 3)


def test_factorize_balanced_and_padded():
    assert tt.factorize(768, 3) == (8, 8, 12)
    assert tt.factorize(3072, 3) == (12, 16, 16)
    assert tt.factorize(4096, 4) == (8, 8, 8, 8)
    assert tt.arrange_modes("tt", (8, 8, 12), (8, 8, 12)) == ((12, 8, 8), (8, 8, 12))
    # 30522 = 2 * 3 * 5087 has no balanced factors: it is padded, a little.
    modes = tt.factorize(30522, 4)
    padded = math.prod(modes)
    assert 30522 <= padded <= 30522 * 1.1 and max(modes) <= 2 * min(modes)
    assert sum(modes) <= sum((16, 20, 10, 10))  # at least as balanced as CoMERA's 32000
    assert tt.factorize(30522, 4, max_pad=0) == (1, 2, 3, 5087)  # exact when padding is off
    for n in (1, 2, 7, 97, 1000, 12345, 65536):
        for k in (1, 2, 3, 4):
            f = tt.factorize(n, k)
            assert len(f) == k and n <= math.prod(f) <= max(n, int(n * 1.1))
    with pytest.raises(ValueError):
        tt.factorize(0, 2)
    with pytest.raises(ValueError):
        tt.factorize(10, 0)


def test_spec_validation():
    with pytest.raises(ValueError, match="fmt"):
        TTSpec("cp", (2,), (2,), (1, 1), 2, 2)
    with pytest.raises(ValueError, match="as many row modes"):
        TTSpec("ttm", (2, 2), (4,), (1, 1, 1), 4, 4)
    with pytest.raises(ValueError, match="less than the matrix"):
        TTSpec("tt", (2, 2), (3,), (1, 2, 2, 1), 5, 3)
    with pytest.raises(ValueError, match="ranks must have"):
        TTSpec("tt", (2, 2), (3,), (1, 2, 1), 4, 3)
    spec = TTSpec("tt", (2, 2), (3,), (1, 2, 2, 1), 4, 3)
    with pytest.raises(ValueError, match="core 1 has shape"):
        tt.materialize([torch.ones(1, 2, 2), torch.ones(2, 2, 3), torch.ones(2, 3, 1)],
                       [torch.ones(2), torch.ones(2)], spec)
    with pytest.raises(ValueError, match="gates"):
        tt.materialize([torch.ones(s) for s in spec.core_shapes], [torch.ones(2)], spec)


@pytest.mark.parametrize("fmt,row_modes,col_modes,rows,cols", [
    ("tt", (3, 4), (5, 2), 11, 9),
    ("tt", (2, 3, 2), (3, 3), 12, 9),
    ("ttm", (3, 4, 2), (2, 3, 2), 23, 12),
])
def test_tt_svd_exact_at_full_rank_and_error_falls_with_rank(fmt, row_modes, col_modes, rows, cols):
    torch.manual_seed(0)
    matrix = torch.randn(rows, cols, dtype=torch.float64)
    sizes = tt.core_sizes(fmt, row_modes, col_modes)
    full = tt.cap_ranks(sizes, tt.normalize_ranks(10_000, len(sizes)))
    spec = TTSpec(fmt, row_modes, col_modes, full, rows, cols)
    cores, err = tt.tt_svd(matrix, spec)
    assert err < 1e-12
    gates = [torch.ones(r, dtype=torch.float64) for r in spec.gate_sizes]
    torch.testing.assert_close(reference_weight(cores, gates, *spec.op_args()), matrix)
    errors = []
    for r in range(1, max(full) + 1):
        s = spec.with_ranks(tt.cap_ranks(sizes, tt.normalize_ranks(r, len(sizes))))
        cores, e = tt.tt_svd(matrix, s)
        assert [c.shape for c in cores] == [torch.Size(x) for x in s.core_shapes]
        g = [torch.ones(n, dtype=torch.float64) for n in s.gate_sizes]
        ref = reference_weight(cores, g, *s.op_args())
        assert e == pytest.approx(((ref - matrix).norm() / matrix.norm()).item(), rel=1e-6, abs=1e-12)
        errors.append(e)
    assert all(b <= a + 1e-12 for a, b in zip(errors, errors[1:]))
    assert errors[0] > 0.3 and errors[-1] < 1e-12


def test_tt_svd_tolerance_picks_ranks():
    torch.manual_seed(1)
    spec0 = TTSpec("tt", (4, 4), (4, 4), (1, 4, 16, 4, 1), 16, 16)
    # A matrix with exact TT ranks (1, 2, 3, 2, 1) plus small noise.
    low = spec0.with_ranks((1, 2, 3, 2, 1))
    cores = [torch.randn(s, dtype=torch.float64) for s in low.core_shapes]
    clean = tt.materialize(cores, [torch.ones(r, dtype=torch.float64) for r in low.gate_sizes], low)
    noisy = clean + 1e-6 * torch.randn_like(clean)
    got, err = tt.tt_svd(noisy, spec0, tol=1e-3)
    assert tuple(c.shape[-1] for c in got[:-1]) == (2, 3, 2)
    assert err <= 1e-3
    _, err_tight = tt.tt_svd(noisy, spec0, tol=0.0)
    assert err_tight < 1e-12
    # On a full-rank random matrix: the error stays within the tolerance and ranks fall as it grows.
    dense = torch.randn(48, 40, dtype=torch.float64)
    for fmt, row_modes, col_modes in (("tt", (4, 3, 4), (2, 4, 5)), ("ttm", (4, 3, 4), (2, 4, 5))):
        sizes = tt.core_sizes(fmt, row_modes, col_modes)
        spec = TTSpec(fmt, row_modes, col_modes,
                      tt.cap_ranks(sizes, tt.normalize_ranks(10_000, len(sizes))), 48, 40)
        previous = None
        for tol in (0.05, 0.2, 0.5, 0.8):
            got, err = tt.tt_svd(dense, spec, tol=tol)
            params = tt.count_params([c.shape for c in got])
            assert err <= tol
            assert previous is None or params <= previous
            previous = params
    # The cap still applies under a tolerance.
    got, err = tt.tt_svd(noisy, spec0.with_ranks((1, 1, 1, 1, 1)), tol=1e-9)
    assert all(c.shape[0] == 1 for c in got) and err > 1e-3


def test_tt_svd_keeps_dtype_and_device():
    m = torch.randn(12, 10, dtype=torch.bfloat16)
    spec = TTSpec("tt", (3, 4), (2, 5), (1, 3, 4, 2, 1), 12, 10)
    cores, err = tt.tt_svd(m, spec)
    assert all(c.dtype == torch.bfloat16 and c.device == m.device for c in cores)
    assert 0 < err < 1


@pytest.mark.parametrize("fmt,row_modes,col_modes,rank,std", [
    ("tt", (6, 4, 4), (4, 4, 6), 8, math.sqrt(1 / (96 + 96))),
    ("ttm", (6, 4, 6), (4, 3, 4), 8, 1.0),
])
def test_random_init_variance(fmt, row_modes, col_modes, rank, std):
    """CoMERA's init: E[W^2] = std^2 exactly, gates 1 (averaged over draws: TT entries are
    correlated, so one draw's sample variance fluctuates)."""
    sizes = tt.core_sizes(fmt, row_modes, col_modes)
    ranks = tt.cap_ranks(sizes, tt.normalize_ranks(rank, len(sizes)))
    spec = TTSpec(fmt, row_modes, col_modes, ranks, math.prod(row_modes) - 1, math.prod(col_modes))
    g = torch.Generator().manual_seed(0)
    second, first = [], []
    for _ in range(64):
        cores = tt.random_cores(spec, std, dtype=torch.float64, generator=g)
        w = reference_weight(cores, [torch.ones(r) for r in spec.gate_sizes], *spec.op_args())
        second.append(w.pow(2).mean().item())
        first.append(w.mean().item())
    assert sum(second) / len(second) == pytest.approx(std ** 2, rel=0.15)
    assert abs(sum(first) / len(first)) < 0.1 * std
