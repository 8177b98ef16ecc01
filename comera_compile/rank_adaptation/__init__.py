"""Rank-adaptive training (CoMERA's multi-objective rank control) as optimizer-step hooks.

``RankAdaptation(model, optimizer, target_compression=...)`` registers two hooks on the optimizer;
the user's model, loss and training loop stay as they are:

* **step pre-hook** adds ``d(gamma_t * S(g)) / dg`` to the rank gates' gradients. ``S`` is the size
  of the tensor-train layers as a function of the gates, ``S = sum_layers sum_k c_k * rho_{k-1} * rho_k``
  with ``rho_k = ||g_k||_1`` (the l0 "rank" of bond k relaxed to l1; ``rho_0 = rho_d = 1``), divided
  by ``W_0``, the mean over all gates of ``dS/d|g|`` when the ranker was built, so that ``gamma`` is the
  average gate's penalty gradient at the start in units of ``u``. With ``scale="grad"`` (default)
  ``u`` is the gates' own loss-gradient scale: a running mean (``grad_ema``) of the mean ``|dL/dg|``
  over all gates, taken each step before the penalty is added (so after any gradient clipping). The
  penalty then holds the same ratio to the loss pull whatever the loss, its scale or the model size:
  ``gamma=1`` (default) pushes the average gate as hard as the loss pulls the average gate, and a gate
  whose own loss gradient is weaker than its push drifts to zero. (Under Adam the push's absolute size
  barely matters, only its ratio to the gradient a gate already gets; gate loss gradients are
  ~5e-4 in a small MSE regression and ~3e-3 in benchmarks/train_lm.py, so no absolute weight suits
  both.) ``scale="absolute"``: ``u = 1``, ``gamma`` in loss units.
  ``c_k`` is core k's chain mode ``s_k`` (``weight="params"``:
  ``S`` counts core parameters, so each gate's penalty is weighted by the parameters its rank carries)
  or, with ``weight="flops"``, the per-token multiply-adds of contracting core k when the input
  streams through the cores in order (a proxy: the planner may pick another order). The gradient is
  ``gamma_t * u * sign(g_{k,i}) * (c_k rho_{k-1} + c_{k+1} rho_{k+1}) / W_0``, on every bond that
  holds more than ``min_rank`` gates (a bond at its floor cannot be pruned further: it is not pushed).
* **the gates' pace.** Under Adam a parameter moves by at most about its learning rate per step,
  so the gates' learning rate bounds how soon any gate reaches the threshold. With
  ``gate_lr_scale="auto"`` (default) gates that would step at the cores' lr (in a group shared with
  other parameters, ``torch.optim.AdamW(model.parameters())``, or in ``cc.param_groups``' own gate
  group at its default lr, the cores') get 10x: the post-hook multiplies their step by 10
  (``g <- g_before + 10 * (g - g_before)``, for SGD, Adam(W), RMSprop, ... exactly the step at 10x
  their group's lr, weight decay included; the optimizer's state is untouched). Gates in a group of
  their own faster than the cores' keep their group's lr; a number scales every gate's step by it.
* **step post-hook** prunes every ``prune_every`` steps: per bond, gates with ``|g| < threshold``
  are removed, keeping at least ``min_rank`` (default 1: the largest), and the cores on both sides
  are sliced physically (each layer's flat core and gate Parameters re-laid out by one gather, same
  Parameter objects; see ``TTParametrization.relayout_``); the surviving gates keep their values (no
  rescaling), so the layer computes exactly what it computed with the pruned gates set to zero.
  With ``rank_multiple=8`` the surviving rank is rounded up (largest gates first, never above the
  current rank). Every optimizer state tensor of a parameter's shape (Adam's
  ``exp_avg``/``exp_avg_sq``, ``max_exp_avg_sq``, SGD's ``momentum_buffer``, ...) and the gradient
  are gathered the same way. Only with ``min_rank=0`` can a bond lose every gate; that makes the
  layer's weight zero, with a warning naming the layer: the layer keeps rank 1 on every bond with
  cores, gates and their optimizer state zeroed (the TT kernels need ranks >= 1), so it stays a zero
  (bias-only) layer: all its gradients and Adam updates are exactly zero from then on, and
  :meth:`RankAdaptation.ranks` reports 0 on its bonds (also for the layer loaded from a checkpoint:
  its all-zero gates say so).

**Stages.** Early: linear scalarization, ``gamma_t = gamma``. Late: achievement scalarization
toward the target point ``(L*, S*)``: ``L* = (1 + loss_tolerance) * EMA(loss)`` at the switch,
``S* = dense_params / target_compression`` (the whole model, as ``compression_report`` counts it).
With the relative gaps ``a = (EMA(loss) - L*) / L*`` and ``b = (size - S*) / S*`` (size: the model
with each bond at the rank a pruning event would leave it now, :meth:`RankAdaptation.effective_params`),
the max term is the size term when ``b > max(a, 0)``: ``gamma_t = late_gamma``; otherwise only the
augmentation term pushes the size:
``gamma_t = augment * late_gamma`` (the loss term's gradient is the user's own backward).
The switch happens at step ``switch`` (an int), when the early stage has converged
(``switch="auto"``, from step ``min_early_steps`` on: over the last ``converge_window`` steps the
loss EMA improved by less than ``converge_tol`` of its value, or by less than ``converge_tol`` of
its whole descent so far, from its highest value to now, which also ends the early stage of a loss
that keeps falling toward zero by a constant factor per window; or the size target is already met),
or by :meth:`RankAdaptation.switch_stage` (``switch="manual"``).

**The loss.** With ``loss_from="output"`` (default) a forward hook on ``model`` records the scalar
loss in its output: the output itself (a model that returns its loss, as ``model(x, labels)`` does in
benchmarks/train_lm.py), its ``loss`` attribute (a Hugging Face ``ModelOutput`` with ``labels=``) or its
``"loss"`` entry (a dict); otherwise call :meth:`RankAdaptation.observe` with the loss each step
(``loss_from="observe"`` turns the hook off). The hook records in training mode only and is
``torch._dynamo.disable``'d, so it never enters a compiled graph. The penalty is added in the step,
i.e. after any gradient clipping the loop does.

**Compiled models.** Dynamo guards on parameter shapes (parameters are static), so the compiled
model recompiles once after a pruning event that changes shapes and the comera planner re-plans
(its plans are keyed on the ranks). Each such event raises ``torch._dynamo.config.recompile_limit``
by ``recompiles_per_event`` when needed (logged), so the old entries never push the model to eager.

**FSDP2.** ``fully_shard`` holds the TT parameters as ``DTensor`` s of fixed shapes, so there pruning
masks instead (``prune_mode="mask"``, chosen by ``"auto"``): the pruned gates are set to zero and held
at zero after every step, the shapes stay (no recompile), and :meth:`RankAdaptation.ranks` /
:meth:`~RankAdaptation.num_params` count the gates left. The layers compute what the sliced ones would.
The gates are read whole (one all-gather per layer where they are needed) and the penalty is written
into each process's shard. :func:`shrink_` slices the masked ranks off an unsharded model (e.g. loaded
from the checkpoint), for the smaller, faster model; a resumed run reads the masks from the gates that
are exactly zero.

**Distributed.** With ``torch.distributed`` initialized, the observed loss is averaged over the
ranks each step and the gate values that decide a pruning event are broadcast from rank 0, so every
rank makes the same decisions. Changing parameter shapes invalidates a ``DistributedDataParallel``
wrapper's buckets: re-wrap the model in an :meth:`RankAdaptation.on_prune` callback.

The package by job:

* :mod:`~comera_compile.rank_adaptation.config`: :class:`RankConfig`, every option, validated once;
* :mod:`~comera_compile.rank_adaptation.objective`: ``S(g)``, ``W_0``, the penalty gradient and the
  effective size (:func:`size_coefficients`);
* :mod:`~comera_compile.rank_adaptation.pruning`: which gates survive, the layers sliced to them;
* :mod:`~comera_compile.rank_adaptation.sharded`: FSDP2's gates read whole and written per shard;
* :mod:`~comera_compile.rank_adaptation.distributed`: the collectives that keep processes in step;
* :mod:`~comera_compile.rank_adaptation.ranker`: :class:`RankAdaptation`, its hooks, stages and state;
* :mod:`~comera_compile.rank_adaptation.plot`: the history as a figure.
"""

from comera_compile.rank_adaptation.config import RankConfig
from comera_compile.rank_adaptation.objective import size_coefficients
from comera_compile.rank_adaptation.pruning import shrink_
from comera_compile.rank_adaptation.ranker import RankAdaptation

__all__ = ["RankAdaptation", "RankConfig", "shrink_", "size_coefficients"]
