"""The block tensor-train format ``"btt"`` (comera_compile/tt/format.py) and its comera::tt_materialize.

Every numeric check compares against ``reference_btt`` below: the matrix assembled block by block in
float64 from the definition, ``M[(j, :), (c, :)] = R[j, :, c, :] diag(g) L[:, c, j, :]``, sharing no
code with the implementation (which contracts one einsum).
"""

import math

import pytest
import torch

from comera_compile import tt
from comera_compile.kernels.tt_materialize import tt_materialize
from comera_compile.tt import TTSpec


def reference_btt(cores, gates, fmt, row_modes, col_modes, rows, cols, transpose):
    """The definition, block by block: row block j, column block c is ``R[j,:,c,:] @ diag(g) @ L[:,c,j,:]``."""
    assert fmt == "btt"
    R, L = (t.to(torch.float64) for t in cores)
    g = gates[0].to(torch.float64)
    (b1, _), (c, _) = row_modes, col_modes
    full = torch.cat([torch.cat([R[j, :, k, :] @ torch.diag(g) @ L[:, k, j, :] for k in range(c)], dim=1)
                      for j in range(b1)], dim=0)
    m = full[:rows, :cols]
    return m.t() if transpose else m


# (row_modes, col_modes, rank, rows, cols): exact sizes, padded rows and columns, rank 1 (Monarch).
SHAPES = [((3, 4), (2, 5), 2, 12, 10), ((4, 3), (3, 5), 3, 11, 14), ((2, 2), (3, 3), 1, 4, 7),
          ((5, 2), (2, 4), 2, 9, 8)]
CASES = [(s, tr) for s in SHAPES for tr in (False, True)]


def _layer(shape, transpose, dtype=torch.float64, seed=0):
    row_modes, col_modes, rank, rows, cols = shape
    spec = TTSpec("btt", row_modes, col_modes, (1, rank, 1), rows, cols, transpose)
    g = torch.Generator().manual_seed(seed)
    cores = [torch.randn(s, dtype=dtype, generator=g) for s in spec.core_shapes]
    gates = [torch.rand(rank, dtype=dtype, generator=g) + 0.5]
    return spec, cores, gates


def test_spec_layout():
    spec = TTSpec("btt", (4, 3), (3, 5), (1, 2, 1), 11, 14, True)
    assert spec.n_cores == 2 and spec.core_shapes == ((4, 3, 3, 2), (2, 3, 4, 5)) and spec.gate_sizes == (2,)
    assert spec.num_params == 4 * 3 * 3 * 2 + 2 * 3 * 4 * 5 + 2 and spec.weight_shape == (14, 11)
    assert spec.bottleneck is None and spec.describe() == "[4x3]|[3x5]"
    assert tt.ranks_from_shapes("btt", spec.core_shapes) == (1, 2, 1)
    assert tt.fit_ranks("btt", (4, 3), (3, 5), (1, 99, 1)) == (1, 3, 1)  # a 3 x 5 block has rank <= 3
    cores = tt.random_cores(spec, 1.0)
    assert TTSpec.from_cores(cores, "btt", (4, 3), (3, 5), 11, 14, True, gates=[torch.ones(2)]) == spec
    with pytest.raises(ValueError, match="two row modes .b1 blocks of b2. and two column modes"):
        TTSpec("btt", (2, 2, 2), (3, 3), (1, 2, 1), 8, 9)
    with pytest.raises(ValueError, match="ranks must have 3 entries"):
        TTSpec("btt", (2, 2), (3, 3), (1, 2, 2, 1), 4, 9)
    with pytest.raises(ValueError, match="core 1 has shape"):
        tt.materialize([cores[0], cores[1][:, :2]], [torch.ones(2)], spec)


@pytest.mark.parametrize("shape,transpose", CASES)
def test_materialize_matches_reference(shape, transpose):
    spec, cores, gates = _layer(shape, transpose, dtype=torch.float32, seed=1)
    want = reference_btt(cores, gates, *spec.op_args())
    for got in (tt.materialize(cores, gates, spec), tt_materialize(cores, gates, *spec.op_args())):
        assert got.shape == spec.weight_shape and got.is_contiguous()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,transpose", CASES)
def test_gradients_match_float64_autograd_of_reference(shape, transpose):
    spec, cores, gates = _layer(shape, transpose, seed=2)
    params = [t.clone().requires_grad_() for t in cores + gates]
    out = tt_materialize(params[:2], params[2:], *spec.op_args())
    probe = torch.randn_like(out)
    got = torch.autograd.grad((out * probe).sum(), params)
    ref_params = [t.clone().requires_grad_() for t in cores + gates]
    want = torch.autograd.grad((reference_btt(ref_params[:2], ref_params[2:], *spec.op_args()) * probe).sum(),
                               ref_params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("transpose", [False, True])
def test_gradcheck(transpose):
    """First and second derivatives (the backward is plain einsums)."""
    spec, cores, gates = _layer(SHAPES[1], transpose, seed=3)
    params = [t.requires_grad_() for t in cores + gates]

    def fn(*p):
        return tt_materialize(p[:2], p[2:], *spec.op_args())

    assert torch.autograd.gradcheck(fn, params)
    assert torch.autograd.gradgradcheck(fn, params)


def test_opcheck():
    spec, cores, gates = _layer(SHAPES[1], True, dtype=torch.float32, seed=4)
    core_flat, gate_flat = (t.requires_grad_() for t in tt.join_flat(cores, gates))
    torch.library.opcheck(torch.ops.comera.tt_materialize.default, spec.materialize_args(core_flat, gate_flat))


def test_monarch_is_full_rank():
    """Rank 1 (a Monarch matrix): every block has rank 1, the matrix is full-rank in general."""
    spec, cores, gates = _layer(((4, 4), (4, 4), 1, 16, 16), False, seed=5)
    w = tt.materialize(cores, gates, spec)
    assert torch.linalg.matrix_rank(w) == 16
    assert all(torch.linalg.matrix_rank(w[4 * j:4 * j + 4, 4 * c:4 * c + 4]) == 1 for j in range(4) for c in range(4))


def _btt_rank_matrix(row_modes, col_modes, rank, rows, cols, seed):
    spec, cores, gates = _layer((row_modes, col_modes, rank, rows, cols), False, seed=seed)
    return reference_btt(cores, gates, *spec.op_args())


@pytest.mark.parametrize("row_modes,col_modes,rows,cols", [((3, 4), (2, 5), 12, 10), ((4, 3), (3, 5), 11, 14)])
def test_svd_reconstructs_a_btt_matrix_and_error_falls_with_rank(row_modes, col_modes, rows, cols):
    top = min(row_modes[1], col_modes[1])
    for r in (1, 2):
        matrix = _btt_rank_matrix(row_modes, col_modes, r, rows, cols, seed=6 + r)
        for cap in (r, top):
            spec = TTSpec("btt", row_modes, col_modes, (1, cap, 1), rows, cols)
            cores, err = tt.tt_svd(matrix, spec)
            assert err < 1e-12
            ones = [torch.ones(cores[0].shape[-1], dtype=torch.float64)]
            torch.testing.assert_close(reference_btt(cores, ones, *spec.op_args()), matrix)
    torch.manual_seed(0)
    dense = torch.randn(rows, cols, dtype=torch.float64)
    errors = []
    for r in range(1, top + 1):
        spec = TTSpec("btt", row_modes, col_modes, (1, r, 1), rows, cols)
        cores, e = tt.tt_svd(dense, spec)
        assert [tuple(c.shape) for c in cores] == list(spec.core_shapes)
        ref = reference_btt(cores, [torch.ones(r, dtype=torch.float64)], *spec.op_args())
        assert e == pytest.approx(((ref - dense).norm() / dense.norm()).item(), rel=1e-6, abs=1e-12)
        errors.append(e)
    assert all(b < a for a, b in zip(errors, errors[1:]))
    assert errors[0] > 0.3 and errors[-1] < 1e-12


def test_svd_is_optimal_against_a_perturbed_btt():
    """Block-wise SVD is the best BTT of its rank: nudging its cores never lowers the error."""
    torch.manual_seed(1)
    dense = torch.randn(12, 10, dtype=torch.float64)
    spec = TTSpec("btt", (3, 4), (2, 5), (1, 2, 1), 12, 10)
    cores, err = tt.tt_svd(dense, spec)
    ones = [torch.ones(2, dtype=torch.float64)]
    for _ in range(5):
        nudged = [c + 1e-3 * torch.randn_like(c) for c in cores]
        assert (reference_btt(nudged, ones, *spec.op_args()) - dense).norm() / dense.norm() >= err


def test_svd_tolerance_picks_the_rank():
    matrix = _btt_rank_matrix((4, 4), (4, 4), 2, 16, 16, seed=9)
    noisy = matrix + 1e-6 * torch.randn(16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    spec = TTSpec("btt", (4, 4), (4, 4), (1, 4, 1), 16, 16)
    cores, err = tt.tt_svd(noisy, spec, tol=1e-3)
    assert cores[0].shape[-1] == 2 and err <= 1e-3
    cores, err = tt.tt_svd(noisy, spec, tol=0.0)
    assert cores[0].shape[-1] == 4 and err < 1e-12
    cores, err = tt.tt_svd(noisy, spec.with_ranks((1, 1, 1)), tol=1e-9)  # the cap wins
    assert cores[0].shape[-1] == 1 and err > 1e-3


def test_svd_keeps_dtype():
    m = torch.randn(12, 10, dtype=torch.bfloat16)
    cores, err = tt.tt_svd(m, TTSpec("btt", (3, 4), (2, 5), (1, 2, 1), 12, 10))
    assert all(c.dtype == torch.bfloat16 for c in cores) and 0 < err < 1


@pytest.mark.parametrize("row_modes,col_modes,rank,std", [((8, 6), (6, 8), 2, 0.02), ((6, 4), (8, 4), 4, 1.0)])
def test_random_init_variance(row_modes, col_modes, rank, std):
    """E[M^2] = std^2 for every entry (gates 1), as a dense layer of init std ``std``."""
    spec = TTSpec("btt", row_modes, col_modes, (1, rank, 1), math.prod(row_modes) - 1, math.prod(col_modes))
    g = torch.Generator().manual_seed(0)
    second, first = [], []
    for _ in range(64):
        cores = tt.random_cores(spec, std, dtype=torch.float64, generator=g)
        w = reference_btt(cores, [torch.ones(rank)], *spec.op_args())
        second.append(w.pow(2).mean().item())
        first.append(w.mean().item())
    assert sum(second) / len(second) == pytest.approx(std ** 2, rel=0.1)
    assert abs(sum(first) / len(first)) < 0.1 * std


def test_chain_planner_declines_btt():
    """A BTT is no chain: plan_linear points to plan_btt_linear, and an embedding's table is formed by the
    marker op (the planner says what that costs)."""
    from comera_compile.tt.planner import plan_embedding, plan_linear

    spec = TTSpec("btt", (4, 3), (3, 5), (1, 2, 1), 11, 14, True)
    with pytest.raises(ValueError, match="'btt' layer is not a chain: plan a linear with plan_btt_linear.*720 FLOPs"):
        plan_linear(spec, 64)
    with pytest.raises(ValueError, match="'btt' embedding"):
        plan_embedding(spec.with_ranks((1, 1, 1)), 64)
