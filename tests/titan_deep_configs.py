"""A torchtitan config for tests/test_titan_trainer.py: the tiny TT model of examples/torchtitan with 10
blocks, more than Dynamo's default recompile_limit (8), so that per-block compiles that do not share one
graph fail (``--module titan_deep_configs --config llama3_tiny_deep_comera``)."""

from comera_configs import TINY, TRAIN_TINY, TT_TINY, _model, _trainer
from comera_compile import titan


def llama3_tiny_deep_comera():
    return titan.configure(_trainer(_model(**dict(TINY, n_layers=10)), lr=1e-3, **TRAIN_TINY), tt=TT_TINY,
                           fused_loss=True, lr=4e-3)
