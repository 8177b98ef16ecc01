"""Ops (torch.library) and their Triton kernels, each beside its torch reference; and ``tt_runtime``,
the TT executor that the TT ops and the compiled graphs share."""
